"""Quantized weights: a layer's weight replaced by a [`eqxscan.quant.Quantized`][]
that stores int8, int4 or fp8 values with float scales and is dequantized where
the layer multiplies by it; inside a [`eqxscan.Stacked`][], one layer at a time,
within the scan's step.
"""

from ._files import load as load, quantize_file as quantize_file, save as save
from ._quantize import (
    dequantize as dequantize,
    quantize as quantize,
    with_int4_storage as with_int4_storage,
    with_kernel as with_kernel,
)
from ._quantized import (
    Int4Storage as Int4Storage,
    Kernel as Kernel,
    Kind as Kind,
    Quantized as Quantized,
)
from ._report import LayerError as LayerError, Report as Report, report as report
