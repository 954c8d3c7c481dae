"""The drop-in optimizers' contract: :class:`TorchOptimizer`, a ``torch.optim.Optimizer`` whose step is
arraytrain's, and the table its subclasses fill (torch's constructor, :data:`~._torch_options.OPTIONS`).

Imported with torch, lazily, by :mod:`arraytrain.interop.torch` (``at_torch.AdamW``): see that
module's docstring for what the classes do. The classes are in :mod:`._torch_dropins`, their
engines in :mod:`._torch_engine` and :mod:`._torch_cohorts`, the options in :mod:`._torch_options`,
the param groups' intake and reads in :mod:`._torch_groups`, the state dict in :mod:`._torch_state`.

How a step runs. The parameters of the param groups live in one or a few engines
(:class:`~._torch_engine.GroupEngine`, a "cohort" each, see :mod:`._torch_cohorts`): parameters that share a dtype
and device, a step count and every hyperparameter that is one number for a whole kernel (betas,
eps, momentum, ...). Usually there is one cohort, so one step is one norm pass and one fused kernel
over every parameter; for Adam and AdamW with float32 state, both in one compiled call
(:meth:`~._torch_engine.GroupEngine.lean_step`; parameters without a gradient left out, each parameter at its own
step count), bitwise the engine's staged step. The class's ``step`` carries its own version of
torch's step wrapper (:func:`~._torch_hooks.hooked`): torch's hooks, and the profiler's range only
while a profiler runs.

A group's hyperparameters are read at every :meth:`TorchOptimizer.step`
(:class:`~._torch_groups.GroupReader`): a tuple of the group's values is compared with the last
one (0-d tensors are read each time); only what changed is validated and mapped. Groups that come
to disagree on a kernel-wide value, a group added by ``add_param_group`` after the first step, and
a ``load_state_dict`` whose groups stand at different steps split the cohorts; the engines are
rebuilt once, their state carried over by parameter name.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from .._checks import check_bool
from ..engine import Engine
from ..errors import ArgumentTypeError, ConcurrentUseError, LayoutError, StateDictError
from ._torch_cohorts import Cohorts
from ._torch_engine import group_name
from ._torch_groups import GroupReader, group_params
from ._torch_hooks import GLOBAL_HOOKS, hooked
from ._torch_options import OPTIONS, check_options
from ._torch_state import check_state, gathered_state, load_entries, published, torch_state_dict


class TorchOptimizer(torch.optim.Optimizer):
    """Base of the drop-in optimizers: a ``torch.optim.Optimizer`` whose step is arraytrain's.

    Subclasses give torch's constructor (their hyperparameters become each group's defaults)
    and :meth:`arraytrain_optimizer`, which builds the arraytrain optimizer for one group's
    values. See :mod:`arraytrain.interop.torch` for the behaviour; the options every class takes
    after its hyperparameters (keyword-only) are:

    max_grad_norm : float or None
        Clip the global L2 norm of the gradient (torch's ``clip_grad_norm_`` rule), inside the
        step: the norm pass the step makes anyway, and the factor folded into the kernel.
    clip_eps : float
        The clip factor is ``max_grad_norm / (norm + clip_eps)`` (1e-6: torch's).
    state_dtype : None, "float32", "bfloat16", "8bit" or "float8"
        Where the optimizer has element-wise state (every class but ``Adafactor`` and ``Sophia``,
        which refuse the argument): None or "float32" keep it in the parameters' dtype (float32
        for a bfloat16/float16 model's master weights); "bfloat16" stores it in bfloat16, math in
        float32; "8bit" stores it as ``bnb.optim.AdamW8bit`` and its siblings do (bitsandbytes'
        blockwise dynamic quantization: a uint8 code per element and a float32 ``absmax`` per
        256-element block, see :mod:`arraytrain.lowbit`), math in float32, for float32 parameters
        or a bfloat16/float16 model's float32 master weights (float64 parameters are refused at
        construction), on the CPU or CUDA as the engine runs it. A parameter with fewer than ``min_8bit_size``
        elements keeps float32 state. An 8-bit slot shows in ``state[p]`` and ``state_dict()`` as
        ``{"codes": uint8 tensor (the parameter's shape), "absmax": float32 tensor (blocks,),
        "map": "signed" or "unsigned"}``, the tensors live views of the engine's bytes (a write
        into them is a write into the state): see :meth:`state_dict`. "float8" keeps the same
        layout with float8 codes (e4m3; e5m2 for second moments) and a float32 ``scale`` per block
        (``{"codes", "scale", "map": "e4m3" or "e5m2"}``), a codec
        cheaper than the dynamic map's.
    min_8bit_size : int or None
        With ``state_dtype="8bit"`` or ``"float8"``: parameters with fewer elements keep their state in float32
        (bitsandbytes' argument of that name; None: its default, 4096). Refused with another
        ``state_dtype``, where it would mean nothing.
    kernels : "numba" or "reference"
        The fused kernels, or their slow reference twins.
    max_consecutive_skips : int or None
        A step whose gradient holds NaN/Inf changes nothing (GradScaler's found_inf, or the
        engine's own check); after this many in a row :class:`~arraytrain.NonFiniteError`
        is raised (None: never). A step under a GradScaler that found an inf is not counted.
    nonfinite : "skip" or "apply"
        "skip": the step finds NaN/Inf in the gradient (in the norm pass it makes anyway) and
        changes nothing. "apply": torch.optim's choice without a GradScaler, the step applies the
        gradient as it is (NaN/Inf reach the weights), and without ``max_grad_norm`` the step
        makes no norm pass at all: one read of the gradients less. Under a GradScaler its
        ``found_inf`` still skips the step.
    comm : a :class:`~arraytrain.parallel.Communicator` or None
        Data parallelism in the optimizer, DDP's work without wrapping the model: every rank
        runs the same model on its share of the batch, and each ``step()`` averages the ranks'
        gradients (one all-reduce, or buckets that overlap the backward pass) before its norm,
        clip and update, so every rank steps identically; the ranks start from rank 0's
        weights (broadcast at construction). E.g. ``arraytrain.distributed.TorchComm()`` under
        ``torchrun``, or ``MPIComm()``. The gradients each rank's ``.grad`` holds until the step
        are its own: clip with ``max_grad_norm=`` (the clip of the averaged gradient, as
        ``clip_grad_norm_`` after DDP's backward), not ``clip_grad_norm_`` before the step. The
        param groups must share one engine (one dtype and device, the same kernel-wide
        hyperparameters). A parameter counts as having a gradient when any rank has one.
    shard_state : bool
        With ``comm``: each rank keeps and updates one contiguous partition of the optimizer state
        (ZeRO stage 1-2, as DDP + ``ZeroRedundancyOptimizer``): a step is a reduce-scatter of the
        gradients, the own partition's update and an all-gather of the weights. ``state[p]`` then
        holds ``"step"`` only (the slots are spread over the ranks), and :meth:`state_dict` and
        :meth:`load_state_dict` are collectives that every rank calls (as ZeRO's
        ``consolidate_state_dict``): ``state_dict()`` returns the whole state, torch's format, on
        every rank. For float32/float64 models, with float32 or bfloat16 state.
    overlap : bool or None
        With ``comm``: start each bucket's all-reduce while the backward pass still runs (a
        post-accumulate-grad hook per parameter copies a gradient torch allocated into the
        buffer and marks it ready). None: on where it can be (float32/float64 parameters, not
        SAM), as :func:`~arraytrain.interop.torch.bind` and DDP do. Accumulating several
        backward passes before one step is then refused by the hook (as bind refuses it):
        pass ``overlap=False`` for that.
    bucket_bytes : int or None
        The overlapped exchange's bucket size (None: an eighth of the gradient, between 1 and
        25 MiB, as :class:`~arraytrain.Engine`).
    """

    _step_supports_amp_scaling = True
    # an arraytrain optimizer that takes two gradient windows per step (SAM) needs a closure
    two_windows = False
    # state_dtype is refused where the arraytrain optimizer takes none (Adafactor, Sophia)
    takes_state_dtype = True
    #: torch's constructor of the class: ``(positional, keyword-only)`` hyperparameters, each a
    #: ``(name, default)`` pair in torch's order; the class's signature is built from it and :data:`OPTIONS`
    HYPERPARAMETERS: tuple = ((), ())
    #: Keys of :data:`~._torch_groups.TUNE_CHECKS` whose new values are set on the arraytrain optimizer as
    #: they are (the attribute of the same name), without building a new one.
    TUNABLE: tuple = ()
    #: group values the class sets itself (AdamW: ``decoupled_weight_decay=True``)
    FIXED: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "HYPERPARAMETERS" in cls.__dict__:
            positional, keyword = cls.HYPERPARAMETERS
            P = inspect.Parameter
            cls.__signature__ = inspect.Signature(
                [P("params", P.POSITIONAL_OR_KEYWORD)]
                + [P(n, P.POSITIONAL_OR_KEYWORD, default=d) for n, d in positional]
                + [P(n, P.KEYWORD_ONLY, default=d) for n, d in (*keyword, *OPTIONS.items())])

    def __init__(self, params, *args, **kwargs):
        """torch's constructor of the class (its ``inspect.signature``), then :data:`OPTIONS`."""
        bound = type(self).__signature__.bind(params, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        options = {k: values.pop(k) for k in OPTIONS}
        del values["params"]
        self.setup(params, {**values, **self.FIXED}, options)

    @classmethod
    def group_defaults(cls, **hyperparameters) -> dict:
        """The param-group defaults ``cls(params, **hyperparameters)`` makes (a ``TypeError`` for an unknown
        or missing name, as the constructor's)."""
        positional, keyword = cls.HYPERPARAMETERS
        P = inspect.Parameter
        sig = inspect.Signature([P(n, P.KEYWORD_ONLY, default=d) for n, d in (*positional, *keyword)])
        bound = sig.bind(**hyperparameters)
        bound.apply_defaults()
        return {**bound.arguments, **cls.FIXED}

    def setup(self, params, defaults: dict, options: Mapping) -> None:
        """What every constructor does: the options (:data:`~._torch_options.OPTIONS`, those not given at
        their defaults) checked, the groups made from ``params`` and ``defaults`` (torch's), the engines
        built."""
        checked = check_options(options, type(self).__name__, self.takes_state_dtype)
        self.max_grad_norm, self.clip_eps = checked.max_grad_norm, checked.clip_eps
        self.state_dtype, self.min_8bit_size, self.kernels = checked.state_dtype, checked.min_8bit_size, checked.kernels
        self.max_consecutive_skips, self.nonfinite = checked.max_consecutive_skips, checked.nonfinite
        self._shard_state = checked.parallel["shard_state"]
        self._groups = GroupReader(defaults, self.TUNABLE, self.arraytrain_optimizer)
        self._cohorts = Cohorts(checked, self.two_windows)
        self._built = False
        self._evaluating = None
        self.reports = ()
        self._groups.check_values(defaults, None)
        if isinstance(params, torch.Tensor):
            raise ArgumentTypeError("params: expected an iterable of tensors, of (name, tensor) pairs or of "
                                    "param-group dicts, got a single tensor")
        try:
            params = list(params)
        except TypeError:
            raise ArgumentTypeError(f"params: expected an iterable of tensors, of (name, tensor) pairs or of "
                                    f"param-group dicts, got {type(params).__name__}") from None
        if not params:
            raise LayoutError("params: an empty parameter list")
        super().__init__(params, defaults)
        self._regroup(self._cohorts.partition(self.param_groups, self._groups.check_values))
        self._built = True

    # -- the arraytrain optimizer of a group ------------------------------------------------
    def arraytrain_optimizer(self, values: Mapping):
        """The :mod:`arraytrain.optim` optimizer for one group's hyperparameters (plain Python values)."""
        raise NotImplementedError

    # -- param groups -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``: the group's parameters join the optimizer, validated first.

        A group added before the first step joins the engine of the groups it agrees with; one
        added later gets an engine of its own, whose step count starts at 0, as torch's
        per-parameter state does.
        """
        if not isinstance(param_group, dict):
            raise ArgumentTypeError(f"param_group: expected a dict, got {type(param_group).__name__}")
        if self._evaluating is not None:
            raise ConcurrentUseError("add_param_group: the optimizer is in eval() mode; call train() first")
        params = group_params(param_group, self.param_groups, self.state_dtype)
        group = {k: v for k, v in param_group.items() if k != "params"}
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        self._groups.check_values(group, group_name(len(self.param_groups)))
        super().add_param_group({**param_group, "params": params})
        if self._built:
            self._regroup(self._cohorts.partition(self.param_groups, self._groups.check_values))

    def _regroup(self, partition, carry: bool = True) -> None:
        """The engines rebuilt for ``partition`` (see :meth:`~._torch_cohorts.Cohorts.rebuild`); then every
        group is read anew at the next read, and ``self.state`` shows the new engines' state."""
        if self._cohorts.rebuild(partition, self.param_groups, self._groups.optimizer_for, carry):
            self._groups.forget(len(self.param_groups))
            self.state = published(self._cohorts, self.param_groups, self._shard_state)

    def read_param_groups(self) -> bool:
        """Read every group and map what changed onto the engines; True when a rate changed.

        Every :meth:`step` calls it first; call it yourself to have a group you edited validated
        at once (a refused value raises :class:`~arraytrain.errors.HyperparameterError` naming the
        group and key, and changes nothing). The fast path: a group's values, as a tuple, equal the last step's (tensors are read every
        time). ``lr`` and ``weight_decay`` are checked alone; the other values build the group's
        arraytrain optimizer (the full validation) only when they changed.
        """
        rates, resigned = self._groups.read(self.param_groups, self._cohorts)
        if resigned and self._cohorts.follow(self._groups):
            self._regroup(self._cohorts.partition(self.param_groups, self._groups.check_values,
                                                  signatures=self._groups.signatures()))
            return self.read_param_groups()
        if rates:
            self._cohorts.set_rates(self._groups.rates)
        return rates

    def _amp(self):
        """``(scale, found_inf)`` from torch.amp.GradScaler's ``grad_scale`` and ``found_inf``, where it set them.

        GradScaler sets both before it calls a step of an optimizer with
        ``_step_supports_amp_scaling`` (``grad_scale`` None when ``scaler.unscale_`` ran already).
        """
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        scale = 1.0 if grad_scale is None else float(grad_scale)
        return scale, found_inf is not None and float(found_inf) != 0.0

    def step(self, closure=None):
        """One optimizer step; returns what ``closure`` (called first, with gradients on) returned.

        The groups are read, the parameters reconnected (see the module docstring), and each engine
        takes its zero-copy step: the norm pass (unscaling a GradScaler's scale, finding NaN/Inf,
        the global norm for ``max_grad_norm``), then one fused kernel that updates the parameters
        and every state slot and zeroes the gradient buffer. A step where no parameter has a
        gradient changes nothing, as torch's. Runs with autograd off (as torch's ``no_grad``, through its
        two C calls: the decorator cost some 12 us a step).
        """
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._step(closure)
        finally:
            torch._C._set_grad_enabled(enabled)

    if None not in GLOBAL_HOOKS:
        step = hooked(step)

    def _step(self, closure):
        if self._evaluating is not None:
            raise ConcurrentUseError("step: the optimizer is in eval() mode (the parameters hold the evaluation "
                                     "weights); call train() first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        elif self.two_windows:
            raise ArgumentTypeError(f"closure: {type(self).__name__}.step needs a closure that zeroes the "
                                    "gradients, computes the loss, calls backward() and returns the loss: "
                                    "it takes a second gradient at the perturbed weights")
        divisor, found_inf = self._amp()
        if found_inf:  # GradScaler skips the step and backs its scale off
            for c in self._cohorts:
                c.engine.clean.clear()
            self.reports = ()
            return loss
        rates = self.read_param_groups()
        reports = self._take(divisor, rates)
        if self.two_windows and reports and all(r.perturbed for r in reports):
            with torch.enable_grad():
                closure()
            reports = self._take(1.0, False)
        self.reports = tuple(reports)
        return loss

    def _take(self, divisor: float, rates: bool) -> list:
        plans = [c.engine.check() for c in self._cohorts]
        if all(len(plan[2]) == len(c.engine.bound) for c, plan in zip(self._cohorts, plans)):
            return []  # no gradient anywhere: torch's optimizers do nothing either
        one = len(self._cohorts) == 1
        if one and divisor == 1.0:
            data_fixes, _, absent, bases = plans[0]
            c = self._cohorts[0]
            if bases is not None and not data_fixes:  # the common step: in one compiled call
                report = c.engine.lean_step(bases, self.max_grad_norm, c.rates, absent)
                if report is not None:
                    c.rates_zeroed = False
                    c.engine.clean = set()
                    c.sync_tensors()
                    return [report]
        for c, (data_fixes, grad_fixes, absent, bases) in zip(self._cohorts, plans):
            if one and bases is not None:  # every gradient is a fresh .grad: read where it lies, nothing copied
                c.engine.connect(data_fixes, [], absent)
                c.engine.read_in_place(bases)
            else:
                c.engine.connect(data_fixes, grad_fixes, absent)
            # a parameter without a gradient: the engine leaves it out of the step (torch's rule); where
            # its optimizer cannot step parameters alone, a zero lr and decay keep its weights
            zeroed = absent if c.engine.missing != "skip" else []
            if rates or zeroed or c.rates_zeroed:
                hp = c.engine.state.hp
                hp["lr"][...] = c.lrs
                hp["weight_decay"][...] = c.wds
                if zeroed:
                    hp["lr"][zeroed] = 0.0
                    hp["weight_decay"][zeroed] = 0.0
            c.rates_zeroed = bool(zeroed)
        for c in self._cohorts:
            e = c.engine
            e.loss_scaler.scale = divisor  # the engine's Divisor: GradScaler's scale, which the gradients carry
            e.max_grad_norm = self.max_grad_norm
        if len(self._cohorts) == 1:
            e, absent = self._cohorts[0].engine, plans[0][2]
            reports = [e.step(absent=self._absent(e, absent))]
        else:  # several engines: one norm, one NaN/Inf verdict and one clip factor over all of them
            reports = Engine.step_together([c.engine for c in self._cohorts],
                                           [self._absent(c.engine, plan[2]) for c, plan in zip(self._cohorts, plans)])
        for c, plan in zip(self._cohorts, plans):
            c.engine.clean = set(plan[2])
            c.sync_tensors()
        return reports

    @staticmethod
    def _absent(engine, absent):
        """The parameters whose ``.grad`` is None, by name, where the engine leaves them out of the step."""
        return [engine.bound[i][0] for i in absent] if absent and engine.missing == "skip" else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``: ``.grad`` set to None, or (``set_to_none=False``) the gradient buffers zeroed.

        ``set_to_none=False`` keeps every ``.grad`` a view of the engine's buffer, so the next
        ``backward()`` adds into it and the step copies nothing; since each step already zeroes the
        buffer inside its kernel, not calling ``zero_grad`` at all between steps does the same.
        """
        set_to_none = check_bool("set_to_none", set_to_none, error=ArgumentTypeError)
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
        if not set_to_none:
            for c in self._cohorts:
                c.engine.zero_grad()
                with torch.no_grad():
                    for _, p, _, grad, *_ in c.engine.bound:
                        if p.grad is not None and p.grad is not grad:
                            p.grad.zero_()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's structure: ``{"state": {index: {"step", slots...}}, "param_groups": [...]}``.

        Per parameter: ``"step"`` (a float tensor, as torch's), one tensor per state slot under
        torch's names (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...), a scalar state such as
        NAdam's ``mu_product``, and for a bfloat16/float16 model ``"master"``, its float32 master
        weights. Groups carry their hyperparameters, ``params`` (indices) and, where the parameters
        were given with names, ``param_names``. The tensors are live views, as torch's are:
        ``torch.save`` them, or copy them to keep a snapshot.

        With ``state_dtype="8bit"`` a slot of a parameter of ``min_8bit_size`` elements or more is
        ``{"codes": uint8 tensor of the parameter's shape, "absmax": float32 tensor (one per
        256-element block), "map": "signed" or "unsigned"}`` (bitsandbytes' ``state1``/``absmax1``
        and the dynamic map its ``qmap1`` holds; value = ``map[code] * absmax``, decoded by
        :func:`arraytrain.lowbit.dequantize`), the same form as the engine's checkpoints; the
        codes and scales are live views, and ``torch.save`` / ``torch.load(weights_only=True)``
        keep them bitwise. A smaller parameter's slot is a float32 tensor. With ``state_dtype="float8"``
        the same, as ``{"codes", "scale", "map": "e4m3" or "e5m2"}`` (value ``map[code] * scale``,
        :func:`arraytrain.lowbit.decode`). No decoded float copy
        is offered in ``state[p]``: writes into it would be lost.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        entries = gathered_state(self._cohorts, self.param_groups) if self._shard_state else self.state
        out = torch_state_dict(self.param_groups, entries)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict) -> None:
        """Load :meth:`state_dict` output (or torch.optim's own, for the same slots), validated first.

        Groups are matched in order; within a group, parameters are matched by name where both
        sides have ``param_names`` (a renamed or missing name is an error), by position otherwise.
        Each group's hyperparameters become the saved ones (torch's rule). A parameter absent
        from ``state`` starts from zero state. Every parameter of a group must stand at the same
        step. A bfloat16/float16 model's float32 master weights come from ``"master"``, or without
        it from the model's current weights. Anything refused raises
        :class:`~arraytrain.errors.StateDictError` before any write.

        Slots convert as the engine's ``load_state_dict`` converts them (:mod:`arraytrain.optim.state8`):
        an 8-bit entry into an 8-bit slot is kept bitwise, into a float32/bfloat16 slot decoded;
        a float tensor (float32, bfloat16, torch.optim's own) into an 8-bit slot is encoded.
        """
        if self._evaluating is not None:
            raise ConcurrentUseError("load_state_dict: the optimizer is in eval() mode; call train() first")
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        plan = check_state(state_dict, self.param_groups, self._cohorts, self._groups.check_values)
        for gi, (values, _) in enumerate(plan["groups"]):
            self.param_groups[gi].update(values)
        # (the load writes every engine's whole state: nothing to carry across)
        self._regroup(self._cohorts.partition(self.param_groups, self._groups.check_values, steps=plan["steps"],
                                              signatures=[s for _, s in plan["groups"]]), carry=False)
        load_entries(self._cohorts, plan, self.param_groups)
        self._groups.forget(len(self.param_groups))
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __reduce_ex__(self, protocol):
        raise ArgumentTypeError(f"{type(self).__name__} cannot be pickled or deep-copied (its state lives in "
                                "arraytrain's buffers): save optimizer.state_dict() and load it into a new one")
