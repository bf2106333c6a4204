"""Recipes: work that drives one area with another, above both data/ and serve/.

teacher_text (`looplm data generate`) writes the original model's own text for the healing corpus by running
the serving engine (through what `looplm.serve` exports) and storing it in data/generated.py's format. A
recipe may import serve/ and data/ (and the areas below them); serve/ and data/ never import a recipe.
"""
