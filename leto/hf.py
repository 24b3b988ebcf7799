"""``from leto.hf import Trainer, TrainingArguments``: Hugging Face ``transformers``'
Trainer under ``leto launch`` (docs/trainers.md). Importing ``leto`` does not import
this module, nor ``transformers``."""

from leto.adapters.hf import Trainer, TrainingArguments

__all__ = ["Trainer", "TrainingArguments"]
