"""Answer checking and rewards.

- `grader`        `grade(prediction, gold, answer_type)`, numeric equality
- `mathvista`     MathVista's official normalisation and scoring, reimplemented
- `symbolic`      the `expression` answer type's symbolic checker (math-verify), bounded in time in a worker
- `rewards`       the built-in TRL reward functions (format, correctness, the gibberish penalty)
- `user_rewards`  the config's `rewards:` list: user functions loaded, checked and weighted

Public, stable paths: `vlmrl.grading.grade`, `vlmrl.grading.normalize_mathvista` (and `vlmrl.rewards`).
"""

from vlmrl.grading.grader import grade, numeric_equal
from vlmrl.grading.mathvista import mathvista_correct, normalize_mathvista

__all__ = ["grade", "mathvista_correct", "normalize_mathvista", "numeric_equal"]
