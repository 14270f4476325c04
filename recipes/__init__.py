"""The recipes that ship with hf-rebasin (``hf-rebasin run --list``): one YAML file each, the format described
in hf_rebasin/recipes.py.  A package only so that the wheel carries the folder and ``hf_rebasin.assets`` finds it
by import, from a clone and from an install alike; it has no code."""
