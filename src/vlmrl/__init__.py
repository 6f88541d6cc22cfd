"""vlmrl.

Importing the package pins the CPU kernels' instruction set before torch first computes
(`vlmrl.common.cpu_numerics`), so a CPU run gives the same digits on every x86-64 host with AVX2.
"""

from vlmrl.common.cpu_numerics import pin_cpu_kernels

pin_cpu_kernels()
