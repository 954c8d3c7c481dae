"""The CPU kernel family (numba): the interface of :mod:`arraytrain.kernels.interface`, by domain.

Importing it compiles nothing: kernels compile on first call and are cached on disk.
"""

from ..interface import LP_BF16, LP_F16, LP_NONE  # noqa: F401
from .reductions import (  # noqa: F401
    accumulate,
    accumulate_packed,
    all_finite,
    cast_working,
    max_abs,
    scale,
    sumsq,
    sumsq_product,
    sumsq_scaled,
)
from .optimizers import (  # noqa: F401
    adafactor_step,
    adagrad_step,
    adam_step,
    lamb_step,
    lion_step,
    rmsprop_step,
    sam_perturb,
    sgd_step,
    sophia_step,
)
from .optimizers import (  # noqa: F401
    adadelta_step,
    adamax_step,
    nadam_step,
    radam_step,
)
from .optimizers import (  # noqa: F401  Muon and schedule-free AdamW
    muon_step,
    schedule_free_adamw_step,
)
from .compression import (  # noqa: F401
    gather,
    int8_decode,
    int8_encode,
    randk_indices,
    scatter,
    sign_decode,
    sign_encode,
    ternary_decode,
    ternary_encode,
    topk,
)
from .projection import (  # noqa: F401
    fwht,
    select_gather,
    select_scatter,
    sign_bind,
)
from .trend import (  # noqa: F401
    trend_correct,
    trend_predict,
)
from ._jit import BLOCK, JIT, SERIAL_BELOW  # noqa: F401
