"""The model-card template (template.md, Jinja) that hf-rebasin fills for every merge (hf_rebasin/hub/cards.py).
A package only so that the wheel carries the folder, as ``hf_rebasin.model_cards`` (pyproject.toml maps it
there), where ``hf_rebasin.assets`` finds it; it has no code."""
