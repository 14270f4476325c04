"""hf-rebasin: merge independently trained transformers by aligning their symmetries."""
__version__ = "0.1.0"
