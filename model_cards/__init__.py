"""The model-card template (template.md, Jinja) that hf-rebasin fills for every merge (hf_rebasin/cards.py).
A package only so that the wheel carries the folder and ``hf_rebasin.assets`` finds it by import, from a clone
and from an install alike; it has no code."""
