"""The public, stable import path of the built-in reward functions (DESIGN: `from vlmrl.rewards import
format_reward, correctness_reward, extract_solution, numeric_equal`). They live in `vlmrl.grading.rewards`;
code inside vlmrl imports them from there (an import-linter contract forbids this module inside the package).
"""

from vlmrl.grading.rewards import correctness_reward, extract_solution, format_reward, numeric_equal

__all__ = ["correctness_reward", "extract_solution", "format_reward", "numeric_equal"]
