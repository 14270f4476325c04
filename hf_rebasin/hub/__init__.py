"""Publishing and reproducing a merge: its model card (cards.py), the push to the Hub (push.py), lm-eval
scores (evals.py) and recipes (recipes.py, recipe_checks.py, with budget.py's cost estimate of learned
matching)."""
