"""The Megatron-Core trainer backend (``strategy=megatron``; docs/megatron.md): ``model.py``
builds the GPTModel, ``mapping.py`` maps its weights to Hugging Face's and back,
``backend.py`` is what the backend registry (``services/trainer/backends.py``) loads."""
