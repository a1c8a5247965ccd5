"""Prompt data in verl's parquet schema: reading, tokenizing, batching, preprocessing.

Import from the submodules (``meshrl.data.dataset``, ``meshrl.data.loader``, ...): this
package stays light, so reward workers that only need ``meshrl.data.boxed`` don't load torch.
"""
