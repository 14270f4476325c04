"""Writing outputs so that nothing is lost and nothing is left half-written: atomic files and staged folders
(io.py) and a canonical graph written as a checkpoint of its original class (checkpoint.py)."""
