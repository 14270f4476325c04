"""The canonical graph (a pre-norm transformer with parameter-free RMSNorms, canonical.py), the symmetry group
that acts on it (symmetry.py) and the exact embedding of a narrow model into a wider one (widths.py): plain
functions of tensors that know no model library and no file."""
