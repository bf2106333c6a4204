"""Recipes: work that drives one area with another, above data/, convert/, eval/ and serve/.

convert (`looplm convert`): the command line's conversion, its settings (``ConvertConfig``) and choices of plan,
rank and calibration (``convert_model``), also for Python users; quantize (`looplm quantize`: ``QuantizeConfig``,
``quantize_model``), which calibrates on a corpus; heal: the healing recipe's defaults (what `looplm heal` chooses
when given only a model); exit_probe (`looplm fit-exit-probe`): the learned exit probe fitted on a corpus's rows.
teacher_text (`looplm data generate`) writes the
original model's own text for the healing corpus by running the serving engine (through what `looplm.serve`
exports) and storing it in data/generated.py's format. A recipe may import the areas below it; they never import
a recipe.
"""

from .convert import ConvertConfig, convert_model
from .quantize import QuantizeConfig, quantize_model

__all__ = ["ConvertConfig", "QuantizeConfig", "convert_model", "quantize_model"]
