"""The Megatron-Core trainer backend (``strategy=megatron``; docs/megatron.md): ``model.py``
builds the GPTModel, ``mapping.py`` maps its weights to Hugging Face's and back,
``backend.py`` is what the backend registry (``services/trainer/backends.py``) loads."""

import warnings

# The local spec needs neither; megatron-core warns so once per module it imports (the
# trainer's log had 30 such lines).
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
