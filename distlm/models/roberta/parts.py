"""RoBERTa's torch parts, which ``distlm.models.roberta.FAMILY`` loads when first asked."""

from distlm.models.roberta.hf import ADAPTER
from distlm.models.roberta.model import RobertaMaskedLM

MODEL = RobertaMaskedLM
HF_ADAPTERS = (ADAPTER,)
