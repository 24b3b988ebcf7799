"""One torchft replica group of a benchmark job (``spec["system"] == "torchft"``).

Configured as torchft's own ``train_ddp.py`` example on CPU: ``ProcessGroupGloo``
(5 s timeout), ``PGTransport`` for healing (10 s), a ``Manager`` with
``min_replica_size=1`` and a 30 s timeout, torchft's ``DistributedDataParallel``
and ``OptimizerWrapper`` around AdamW. Each rank of the job is its own replica
group of one rank (torchft's DDP averages gradients across replica groups only; a
group of two would need FSDP/HSDP inside it, as its example says), with its own
``TCPStore`` hosted by the agent (as torchrun per group does). The model is seeded
identically everywhere, so ``init_sync=False``, as torchft's docstring advises.

One workaround, of a bug of torchft 0.2.0's ``DistributedDataParallel``: its comm
hook asserts that the all-reduce's future chain exists, but when the all-reduce
fails (a peer died: gloo's "Connection reset by peer") torchft's ``_ManagedWork.wait``
reports the error to the manager and returns False before building that chain, so
the assertion kills every surviving group. :class:`_FTDDP` returns the bucket
as it is instead; the manager already knows of the error, and the step is not
committed (the documented behaviour: "the Future will be completed with no error
and instead tracked asynchronously").

Events on the agent's pipe, beyond the common ones (:mod:`leto.bench.worker`):
``model`` (model and optimizer built), ``pg`` (the manager up: its server
heartbeating to the lighthouse), ``heal_start`` (the quorum reached and the
process group configured: the checkpoint from a live peer starts to arrive),
``heal_recv`` (it arrived), ``loaded`` (torchft applied it, at the step's commit),
``heal_send`` (a live peer sent its state), ``step`` (a committed step, with the
quorum's ``participants``) and ``discard`` (a step torchft did not commit: an
error in the step's all-reduce, such as a peer's death).

Failures come from the agent's ``SIGUSR1`` (``leto bench goodput``: at the next point
after a forward pass), or from the whole schedule (``plan["schedule"]``): failure ``i`` is this
process's if it names this rank and ``i`` is at least the number of failures the job
had when this process started; it strikes at the first step at or after its step
whose point (``forward`` or ``update``) this process reaches once the benchmark has
armed it (``armed/<i>`` in the job's store, set when recovery ``i - 1`` is over: the
other groups train on during a recovery, so without it a failure could strike
during the previous one's).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .worker_base import Trainer

__all__ = ["FTTrainer"]


def _ddp_class() -> Any:
    import torch
    import torch.distributed as dist
    import torchft

    def hook(state: Any, bucket: Any) -> Any:
        work = state.allreduce(bucket.buffer())
        ok = work.wait()
        fut = work.get_future()
        if ok and getattr(fut, "_fut", None) is not None:
            return fut._fut
        if ok:  # torchft's _DummyWork (the step had errored already): a plain future
            return fut
        done: Any = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    # DDP checks the hook's annotations as objects (this module's are strings)
    hook.__annotations__ = {
        "bucket": dist.GradBucket,  # type: ignore[attr-defined] # (torch's stubs: c10d)
        "return": torch.futures.Future[torch.Tensor],
    }

    class _FTDDP(torchft.DistributedDataParallel):  # type: ignore[misc] # (torchft: untyped)
        _comm_hook = staticmethod(hook)

    return _FTDDP


class FTTrainer(Trainer):
    def run(self) -> None:
        import torchft
        from torchft.checkpointing.pg_transport import PGTransport

        out = self.out

        class StampedTransport(PGTransport):  # type: ignore[misc] # (torchft: untyped)
            """torchft's PGTransport, reporting when a heal's transfer starts and ends."""

            def send_checkpoint(self, *a: Any, **kw: Any) -> None:
                super().send_checkpoint(*a, **kw)
                out.emit("heal_send")

            def recv_checkpoint(self, *a: Any, **kw: Any) -> Any:
                out.emit("heal_start")
                sd = super().recv_checkpoint(*a, **kw)
                out.emit("heal_recv")
                return sd

        model = self.wl.build_model()
        inner = self.wl.build_optimizer(model)
        self.out.emit("model")

        def load_state_dict(sd: dict[str, Any]) -> None:
            model.load_state_dict(sd["model"])
            inner.load_state_dict(sd["optim"])
            self.out.emit("loaded", step=self.manager.current_step())

        def state_dict() -> dict[str, Any]:
            return {"model": model.state_dict(), "optim": inner.state_dict()}

        pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=5))
        transport = StampedTransport(
            pg, timeout=timedelta(seconds=10), device=self.torch.device("cpu")
        )
        self.manager = torchft.Manager(
            pg=pg,
            min_replica_size=1,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            replica_id=f"leto_bench_{self.rank}",
            timeout=timedelta(seconds=30),
            checkpoint_transport=transport,
            store_addr="127.0.0.1",
            store_port=self.spec["group_stores"][self.rank],
            rank=0,
            world_size=1,
            lighthouse_addr=self.spec["lighthouse"],
            hostname="127.0.0.1",
            init_sync=False,
        )
        self.ddp = _ddp_class()(self.manager, model)
        self.opt = torchft.Optimizer(self.manager, inner)
        self.out.emit("pg")
        self.plan = self.get_plan(f"plan/{self.gen}")
        self.fails = [
            (i, f)
            for i, f in enumerate(self.plan["schedule"])
            if f["rank"] == self.rank and i >= self.gen
        ]
        self.train()

    def due(self, s: int, at: str) -> bool:
        """Is this process's next failure due at point ``at`` of step ``s``, and armed?"""
        if not self.fails:
            return False
        i, f = self.fails[0]
        return f.get("at", "forward") == at and s >= f["step"] and self.store.check([f"armed/{i}"])

    def train(self) -> None:
        m = self.manager
        while True:
            self.opt.zero_grad(set_to_none=True)  # torchft: starts the step's quorum
            s = m.current_step() + 1  # a healing process's first batch is discarded anyway
            loss = self.loss(self.ddp, s)
            # its schedule's failure (recovery, scaling), or the agent's SIGUSR1 (goodput)
            if self.due(s, "forward") or self.should_fail(s, "forward"):
                self.die(s)
            loss.backward()  # the all-reduce waits for the quorum (and a heal's transfer)
            before = m.current_step()
            if self.due(before + 1, "update"):
                self.die(before + 1)
            self.opt.step()  # torchft: should_commit, then AdamW's step if committed
            if m.current_step() == before + 1:
                self.out.emit("step", step=before + 1, participants=m.num_participants())
            else:
                self.out.emit("discard", step=before + 1)
