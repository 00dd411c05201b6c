"""What the stages share: settings, device, optimizers, schedules, the progress line, selection, checkpoints, the CUDA
graph of a step."""
import argparse
import ctypes
import functools
import glob
import itertools
import math
import os
import random
import sys
import time
import timeit
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from model import heads_for

# -----------------------------------------------------------------------------
# device, numerics, arguments


def autocast(device, amp="auto"):
    """auto: bf16 autocast on CUDA, fp32 on a CPU; bf16: anywhere."""
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def device_arg(text):
    try:
        d = torch.device(text)
    except RuntimeError:
        d = None
    if d and d.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA here (torch {torch.__version__}); pass --device cpu")
    n = torch.cuda.device_count()
    if d is None or d.type not in ("cpu", "cuda") or d.type == "cuda" and (d.index or 0) >= n:
        here = "cpu" + (f", cuda:0 to cuda:{n - 1}" if n else "")
        raise argparse.ArgumentTypeError(f"{text!r} is not a device here; this machine has {here}")
    return text


def at_least(low, kind=int, most=None, below=None):
    """argparse type: a number >= low (and <= most, < below)."""
    def number(text):
        try:
            x = kind(text)
        except ValueError:
            x = None
        if x is None or not (x >= low and (most is None or x <= most) and (below is None or x < below)):  # and nan
            within = (f"in [{low}, {most}]" if most is not None else f"in [{low}, {below})" if below is not None else
                      f">= {low}")
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} {within}, "
                                             f"got {text!r}")
        return x
    number.__name__ = f"{kind.__name__} >= {low}"
    return number


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help: the docstring as written, each flag's default."""

    def _get_help_string(self, action):
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        return action.help + ("" if hidden else " (default: %(default)s)")


def run_flags(p, log_every=20, warmup=0.1, pre=None):
    """pre: the stage's preset_values, its presets deciding --warmup and --grad-clip."""
    of_presets = lambda k: f" {pre(k)}" if pre else ""
    p.add_argument("--resume", action="store_true", help="continue the run whose --out this is")
    p.add_argument("--seed", type=int, default=0, help="random seed (initialization, data order, draws)")
    device_flags(p)
    p.add_argument("--warmup", type=at_least(0.0, float, below=1.0), default=None if pre else warmup,
                   help="fraction of the steps of linear warmup, then the schedule's decay" + of_presets("warmup"))
    p.add_argument("--grad-clip", type=at_least(0.0, float), default=None if pre else 1.0,
                   help="max gradient norm (0: off)" + of_presets("grad_clip"))
    p.add_argument("--log-every", type=at_least(1), default=log_every, help="steps between progress lines")


def preset_values(presets):
    """help's "[paper: 1e-4, mini: 1e-3]" of a setting."""
    return lambda k: "[" + ", ".join(f"{n}: {v[k]}" for n, v in presets.items() if v[k] is not None) + "]"


def device_flags(p):
    p.add_argument("--device", type=device_arg, default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"],
                   help="mixed precision: auto = bf16 autocast on CUDA, fp32 on a CPU")


def image_cache_flag(p):
    p.add_argument("--image-cache", action=argparse.BooleanOptionalAction, default=None, help="decode every image "
                   "once into a uint8 file ($CLIP4IDC_IMAGE_CACHE, else ~/.cache/clip4idc/images); default: if it fits")


class Settings(SimpleNamespace):
    """A run's settings, decided before any work, printed and saved: read-only."""

    def __setattr__(self, name, value):
        raise AttributeError(f"settings are decided before the run starts: {name} stays {getattr(self, name, None)!r}")

    __delattr__ = __setattr__

    def line(self):
        return " ".join(f"{k}={v}" for k, v in sorted(vars(self).items()))


def given_flags(parser, argv=None):
    """The settings the command line gives: parsed again, defaults suppressed."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, default in saved:
            a.default = default


def over_preset(flags, given, presets, preset, bad):
    """The preset's values, a flag given winning over its value (what the weights or data decide comes after, in the
    stage's settings()); --authors-numerics: BertAdam's fp16, no autocast."""
    s = {**vars(flags), **presets[preset], **{k: getattr(flags, k) for k in given}, "preset": preset}
    if s["authors_numerics"]:
        if "amp" in given:
            bad("--amp", "--authors-numerics runs their fp16, without autocast: leave --amp out")
        s["amp"] = "off"
    return s


def pick_device(device=None):
    """--device, else cuda:0 where there is a GPU, else cpu."""
    d = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return f"cuda:{d.index or 0}" if d.type == "cuda" else "cpu"


def concrete_amp(amp, device):
    """--amp auto as it runs: bf16 on CUDA, off on a CPU."""
    return ("bf16" if device.startswith("cuda") else "off") if amp == "auto" else amp


def check_sizes(parser, image_size, patch_size, widths):
    """Whole patches, widths ({flag: width}) that split into width // 64 heads."""
    if image_size % patch_size:
        parser.error(f"argument --image-size: {image_size} is not a multiple of --patch-size {patch_size}")
    for flag, w in widths.items():
        if w % heads_for(w):
            parser.error(f"argument {flag}: {w} does not split into width // 64 heads: give a multiple of 64")


def flag_error(flag, message):
    print(f"{os.path.basename(sys.argv[0])}: error: argument {flag}: {message}", file=sys.stderr)
    raise SystemExit(2)


def keep_freed_memory():
    """glibc keeps freed memory (else large allocations fault in fresh pages every step)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def setup(seed=0, device=None, amp="auto"):
    device = torch.device(pick_device(device))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # for CUDA graphs' streams
        # TF32 beside bf16 autocast; --amp off: plain fp32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = amp != "off"
    if device.type == "cpu":
        keep_freed_memory()
    seed_everything(seed)
    return SimpleNamespace(device=device, amp=autocast(device, amp))


@functools.lru_cache
def matmul_gflops(n=2048, repeats=5):
    """This CPU's fp32 GFLOP/s, the best of `repeats` n x n matmuls."""
    g = torch.Generator().manual_seed(0)  # the run's random stream untouched
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b
    return 2 * n ** 3 / min(timeit.timeit(lambda: a @ b, number=1) for _ in range(repeats)) / 1e9


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def where(ctx, speed=False):
    """The machine in a few words; speed: a CPU's GFLOP/s too."""
    if ctx.device.type == "cuda":
        return torch.cuda.get_device_name(ctx.device)
    return f"CPU, {torch.get_num_threads()} threads" + (f", {matmul_gflops():.0f} GFLOP/s fp32" if speed else "")


def log(*args):
    print(*args, flush=True)


# -----------------------------------------------------------------------------
# optimization


def authors_schedule(optimizer, total_steps, warmup_frac=0.1, kind="cosine"):
    """The authors' schedules of x = step / total_steps (optimization.py 26-42): stage 1's cosine, stage 2's linear."""
    def factor(step):
        x = step / total_steps
        if x < warmup_frac:
            return x / warmup_frac
        return 0.5 * (1.0 + math.cos(math.pi * x)) if kind == "cosine" else max(0.0, (x - 1.0) / (warmup_frac - 1.0))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def freeze(named_params, rule):
    """A stage's lr_rule (name -> learning rate, None: frozen) as requires_grad."""
    for name, p in named_params:
        p.requires_grad_(rule(name) is not None)


def param_groups(named_params, rule, weight_decay, decays=None):
    """The trained parameters grouped by rate and decay; decays(name, p): decayed? (default: matrices)."""
    groups = {}
    for name, p in named_params:
        if (lr := rule(name)) is not None:
            decayed = decays(name, p) if decays else p.ndim >= 2
            groups.setdefault((lr, weight_decay if decayed else 0.0), []).append(p)
    return [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]


def policy_table(named_params, rule):
    """The rule as a table: a line per group of names and rate, its size."""
    rows = {}
    for name, p in named_params:
        parts = name.split(".")
        parts = parts[:-1] if parts[-1] in ("weight", "bias") or len(parts) > 3 else parts
        group = ".".join(list(itertools.takewhile(lambda s: not s.isdigit(), parts))[:3])
        key = (group, rule(name))
        rows[key] = rows.get(key, 0) + p.numel()
    rate = lambda lr: "frozen" if lr is None else f"lr {lr:g}"
    return "\n".join(f"   {group:<40} {rate(lr):>10} {n:>12,}" for (group, lr), n in rows.items())


def authors_decays(model, bert=None):
    """The authors' decay sets (prep_optimizer): all but biases and `bert`'s LayerNorms."""
    bert_ln = {f"{bert}.{n}.weight" for n, m in getattr(model, bert).named_modules()
               if isinstance(m, torch.nn.LayerNorm)} if bert else set()
    return lambda name, p: "bias" not in name and name not in bert_ln


class BertAdam(torch.optim.Optimizer):
    """The authors' BertAdam (optimization.py 110-167): Adam without bias correction, decoupled decay,
    moments in the weights' dtype (their per-tensor clip after a global one: a no-op)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):  # their defaults
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.scratch = {}  # two buffers per dtype and device, reused: a step allocates nothing (faster on a CPU)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["next_m"], state["next_v"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v, g = state["next_m"], state["next_v"], p.grad
                update, decay = self.buffers(p)
                m.mul_(b1).add_(g, alpha=1 - b1)  # their order and roundings, so that fp16 rounds as theirs
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                torch.div(m, torch.sqrt(v, out=update).add_(group["eps"]), out=update)  # m / (sqrt(v) + eps)
                if group["weight_decay"] > 0.0:
                    update.add_(torch.mul(p, group["weight_decay"], out=decay))
                p.add_(update.mul_(-lr))

    def buffers(self, p):
        key, n = (p.dtype, p.device), p.numel()
        if key not in self.scratch or self.scratch[key].shape[1] < n:  # grows in the first step only
            self.scratch[key] = p.new_empty(2, n)
        return (b[:n].view_as(p) for b in self.scratch[key])


class GraphedStep:
    """A stage's `update(batch) -> loss` captured once as a CUDA graph and replayed, then the schedule's step; other
    shapes (and a CPU) run eagerly."""

    def __init__(self, ctx, update, optimizer, scheduler, params):
        self.ctx, self.body, self.params, self.optimizer, self.scheduler = ctx, update, params, optimizer, scheduler
        self.graph = None
        for g in optimizer.param_groups:  # the graph reads this address
            g["lr"] = torch.tensor(float(g["lr"]), device=ctx.device)

    def __call__(self, batch):
        if self.ctx.device.type == "cuda" and self.graph is None:
            self.capture(batch)
        if self.graph is not None and shapes(batch) == shapes(self.static):
            for k, t in batch.items():
                self.static[k].copy_(t, non_blocking=True)
            self.graph.replay()
            out = self.out.clone()  # the next replay overwrites it
        else:  # eagerly, into the graph's gradients (zeroed in place)
            self.optimizer.zero_grad(set_to_none=self.graph is None)
            out = self.body(batch)
        self.scheduler.step()
        return out

    def capture(self, batch):
        self.static = {k: t.to(self.ctx.device, non_blocking=True).clone() for k, t in batch.items()}
        weights = [p.detach().clone() for p in self.params]
        state = {p: {k: v.clone() for k, v in s.items()} for p, s in self.optimizer.state.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # allocations, workspaces, the optimizer's state
            for _ in range(3):
                self.optimizer.zero_grad(set_to_none=True)
                self.body(self.static)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():  # the warm-up undone
            for p, w in zip(self.params, weights):
                p.copy_(w)
            for p, s in self.optimizer.state.items():
                for k, v in s.items():
                    v.copy_(state[p][k] if p in state else torch.zeros_like(v))
        self.optimizer.zero_grad(set_to_none=True)  # the graph allocates the gradients it writes
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.body(self.static)
        log(f"   the training step captured as one CUDA graph, batch {shapes(batch)}")


def shapes(batch):
    return {k: tuple(t.shape) for k, t in batch.items()}


@dataclass
class Progress:
    """What the progress line says: `epoch` (0-based) of `epochs`, every `log_every` steps."""
    epoch: int
    epochs: int
    total_steps: int
    log_every: int = 20
    unit: str = "pairs"


def train_epoch(ctx, loader, step, optimizer, run, progress):
    """`step(batch) -> loss` on each batch -> the mean loss; a NaN stops."""
    t0, seen, count, checked = time.time(), 0, 0, run["step"]
    total = torch.zeros((), device=ctx.device)
    for batch in loader:
        loss = step(batch)
        total += loss.float()
        run["step"], seen, count = run["step"] + 1, seen + len(next(iter(batch.values()))), count + 1
        if run["step"] % progress.log_every == 0 or count == len(loader):
            if not torch.isfinite(total):  # the host syncs here only
                raise SystemExit(f"loss became {loss.item()} between steps {checked + 1} and {run['step']} (epoch "
                                 f"{progress.epoch + 1}): stopping. The last good checkpoint is kept; start again "
                                 f"with a lower learning rate (--resume would keep the old one).")
            checked = run["step"]
            eta = (progress.total_steps - run["step"]) * (time.time() - t0) / count
            lrs = "/".join(f"{lr:.2e}" for lr in sorted({float(g["lr"]) for g in optimizer.param_groups}, reverse=True))
            log(f"epoch {progress.epoch + 1}/{progress.epochs} step {run['step']}/{progress.total_steps} | loss "
                f"{loss.item():.4f} | lr {lrs} | {seen / (time.time() - t0):.1f} {progress.unit}/s | ETA "
                f"{fmt_time(eta)}")
    return total.item() / max(1, count)


def new_run():
    return dict(epoch=0, step=0, best=-1.0, best_epoch=0, epochs_without_gain=0, history=[])


def end_epoch(run, loss, figures, score):
    """An epoch's loss and val figures into `run` -> whether `score` is the best so far (a tie: the later epoch, as
    the authors')."""
    better = score >= run["best"]
    run["epoch"] += 1
    run["history"].append({"epoch": run["epoch"], "loss": loss, **figures})
    run["epochs_without_gain"] = 0 if better else run["epochs_without_gain"] + 1
    if better:
        run.update(best=score, best_epoch=run["epoch"])
    return better


def fmt_time(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# -----------------------------------------------------------------------------
# checkpoints: plain dicts, written aside and renamed


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_atomic(obj, path):
    """torch.save to a temporary file renamed into place."""
    path = str(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(to_cpu(obj), tmp)
    os.replace(tmp, path)
    for left in glob.glob(glob.escape(path) + ".tmp*"):  # dead writers'
        os.remove(left)


def last_path(out):
    """adapted.pt -> adapted.last.pt, the resumable state."""
    root, ext = os.path.splitext(str(out))
    return f"{root}.last{ext or '.pt'}"


def check_resume(parser, resume, out):
    if resume and not os.path.isfile(last_path(out)):
        parser.error(f"argument --resume: no resumable state at {last_path(out)}; start without --resume")


def load_resume(out, device="cpu"):
    path = last_path(out)
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise SystemExit(f"--resume: cannot read {path} ({type(e).__name__}: {e}); start without --resume") from None


def save_state(out, model, optimizer, scheduler, run, args, **extra):
    """The resumable state: run's keys, the model's, optimizer's, schedule's and random streams'."""
    save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "rng": rng_state(), **run, "args": vars(args), **extra}, last_path(out))


RESUMABLE = {"resume", "device", "workers", "log_every", "eval_batch_size", "image_cache", "time_limit"}  # may change


def resume_run(state, model, optimizer, scheduler, args):
    """save_state's file put back -> its run; a setting other than the saved one is an error."""
    if missing := [k for k in new_run() if k not in state]:
        raise SystemExit(f"--resume: the state has no {missing[0]} (an older clip4idc's): start without --resume")
    for k, v in state.get("args", {}).items():
        if k not in RESUMABLE and vars(args).get(k, v) != v:
            raise SystemExit(f"--resume: the run was set {k}={v!r}, this command {k}={getattr(args, k)!r}: give the "
                             f"run's flags")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    run = {k: state[k] for k in new_run()}
    log(f"   resumed from epoch {run['epoch']}'s state (best val {run['best']:.2f}, epoch {run['best_epoch']})")
    return run


def interrupted(out):
    log(f"\ninterrupted: the last finished epoch is saved in {last_path(out)}; continue with --resume")
    sys.exit(130)
