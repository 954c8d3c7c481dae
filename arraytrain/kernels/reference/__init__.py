"""The reference kernel family (NumPy, float64 math rounded once): the tests' oracle, by domain.
"""

from ..interface import export

#: Every kernel of :data:`~arraytrain.kernels.interface.KERNELS`, from its domain's module.
__all__ = export(globals(), __name__)
