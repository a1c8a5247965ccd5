"""What a run records: metrics sinks (console, JSONL, TensorBoard, wandb, ...), the history
read back, plots, validation metrics and the generation dumps."""
