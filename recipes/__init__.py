"""The recipes that ship with hf-rebasin (``hf-rebasin run --list``): one YAML file each, the format described
in hf_rebasin/hub/recipes.py.  A package only so that the wheel carries the folder, as ``hf_rebasin.recipes``
(pyproject.toml maps it there), where ``hf_rebasin.assets`` finds it; it has no code."""
