"""The CUDA kernel family against the reference twins: the CPU family's own tests, run on the GPU.

Each test below is imported from the CPU kernel tests and runs with the module's fast
family (``cpu``) swapped for the CUDA family behind NumPy arguments
(``cuda_family.ON_DEVICE``): the same sizes (0, 1, 7, 1037, 278011 with zero-size
parameters first, middle and last), steps, per-parameter hyperparameters, working
copies, bfloat16 state, masks and NaN/Inf cases, and the same tolerances. Skipped
without a usable GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "optim"))  # the optimizers' kernel tests

import test_adafactor
import test_amp
import test_intake_fast
import test_kernels
import test_kernels_optim
import test_muon
import test_prune
import test_sam
import test_schedule_free
import test_sophia
from cuda_family import ON_DEVICE, require_cuda

# re-collected here; their globals stay those of their own module
from test_adafactor import test_kernel_matches_reference as test_adafactor_kernel_matches_reference  # noqa: F401
from test_adafactor import test_nan_propagates_as_in_the_reference, test_working_copy_written_in_the_same_pass  # noqa: F401
from test_intake_fast import test_accumulate_packed_matches_reference  # noqa: F401
from test_amp import test_adam_bfloat16_state_kernel_matches_reference, test_cast_working_is_bitwise_the_numpy_cast  # noqa: F401
from test_kernels import (  # noqa: F401
    test_accumulate_matches_reference,
    test_adam_step_matches_reference,
    test_all_finite_detects_nonfinite,
    test_all_finite_empty_buffer,
    test_all_finite_true_on_finite_data,
    test_identical_runs_are_bitwise_equal,
    test_max_abs_matches_reference,
    test_max_abs_with_inf,
    test_scale_matches_reference,
    test_sgd_step_matches_reference,
    test_sumsq_matches_reference,
    test_sumsq_nonfinite_total,
    test_sumsq_scaled_matches_reference,
)
from test_kernels_optim import (  # noqa: F401
    test_bfloat16_state_matches_reference,
    test_matches_reference,
    test_nonfinite_gradient_propagates_as_reference,
    test_working_copy_matches_reference,
)
from test_prune import test_masked_kernel_matches_reference, test_working_copy_sees_the_masked_weights  # noqa: F401
from test_sam import test_perturb_kernel_matches_reference, test_sumsq_product_matches_reference  # noqa: F401
from test_sophia import test_kernel_matches_reference as test_sophia_kernel_matches_reference  # noqa: F401
from test_sophia import test_nonfinite_propagates_as_in_the_reference  # noqa: F401

from test_muon import test_bfloat16_momentum_matches_reference  # noqa: F401
from test_muon import test_kernel_matches_reference as test_muon_kernel_matches_reference  # noqa: F401
from test_muon import test_nonfinite_propagates_as_in_the_reference as test_muon_nonfinite  # noqa: F401
from test_muon import test_working_copy_and_mask as test_muon_working_copy_and_mask  # noqa: F401
from test_schedule_free import test_bfloat16_second_moment_matches_reference  # noqa: F401
from test_schedule_free import test_kernel_matches_reference as test_schedule_free_kernel_matches_reference  # noqa: F401
from test_schedule_free import test_nonfinite_propagates_as_in_the_reference as test_schedule_free_nonfinite  # noqa: F401
from test_schedule_free import test_working_copy_and_mask as test_schedule_free_working_copy_and_mask  # noqa: F401

MODULES = (test_adafactor, test_amp, test_intake_fast, test_kernels, test_kernels_optim, test_prune, test_sam, test_sophia,
           test_muon, test_schedule_free)


@pytest.fixture(autouse=True)
def cuda_family(monkeypatch):
    require_cuda()
    for module in MODULES:
        monkeypatch.setattr(module, "cpu", ON_DEVICE)
