"""vlmrl.

Importing the package pins the CPU kernels' instruction set before torch first computes
(`vlmrl.common.cpu_numerics`), so the host's instruction set does not decide a CPU run's digits.
"""

from vlmrl.common.cpu_numerics import pin_cpu_kernels

pin_cpu_kernels()
