"""Q5: DCP save of a 2-D (dp=2 x tp=2) FSDP2+TP model + Adam via get_state_dict, then
load (resharding) into other layouts: 4x1 (dp=4, tp=1, TP plan kept), plain FSDP
(dp=4), HSDP (2x2), and 2x2 itself.  The target models have params and Adam state
bound to external memfd buffers (common.ExternalStore): DCP must load IN PLACE
(views intact).  Check: full tensors of params and exp_avg/exp_avg_sq/step equal
bitwise to those saved; then one more training step runs.

run (from the repository root): python docs/research/fsdp2/proto_dcp.py
"""

import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from common import ExternalStore, bitwise_equal, build, free_port, init_pg, make_mesh, train
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

DIR = os.path.join(tempfile.gettempdir(), "leto-fsdp2-proto-ckpt")


def full(model, opt):
    out = {}
    for n, p in model.named_parameters():
        out[n] = p.full_tensor().detach().clone()
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{k}"] = st[k].full_tensor().detach().clone()
        out[f"{n}.step"] = st["step"].clone()
    return out


def make(cfg, mesh):
    model = build("tf", cfg, mesh, seed=123)  # different init than the saved model
    st = ExternalStore(model)
    st.bind_params()
    st.bind_grads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    st.precreate_adam_state(opt)
    return model, opt, st


def save_phase(rank, world, port, q):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_pg(rank, world, port)
    mesh = make_mesh("2d")
    model, opt, st = make("2d", mesh)
    train(model, opt, "2d", mesh, 3)
    ref = full(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=DIR)
    if rank == 0:
        torch.save(ref, DIR + "/ref.pt")
    dist.barrier()
    dist.destroy_process_group()
    q.put((rank, "saved"))


def load_phase(rank, world, port, q):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_pg(rank, world, port)
    ref = torch.load(DIR + "/ref.pt")
    res = {}
    for cfg in ("4x1", "fsdp", "hsdp", "2d"):
        try:
            mesh = make_mesh(cfg)
            model, opt, st = make(cfg, mesh)
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=DIR)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            got = full(model, opt)
            eq = all(bitwise_equal(ref[k], got[k]) for k in ref) and set(ref) == set(got)
            v = st.check_views(opt)
            views = v["param"] and v["state"]
            train(model, opt, cfg, mesh, 1, start=3)
            v2 = st.check_views(opt)
            res[cfg] = (
                f"loaded bitwise={eq} views_after_load={views} views_after_step={v2['param'] and v2['state']}"
            )
        except Exception as e:
            import traceback

            traceback.print_exc()
            res[cfg] = f"ERROR {type(e).__name__}: {str(e)[:200]}"
    dist.barrier()
    dist.destroy_process_group()
    q.put((rank, res))


def spawn(fn):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=fn, args=(r, 4, port, q)) for r in range(4)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in range(4))
    for p in procs:
        p.join()
    return res


if __name__ == "__main__":
    shutil.rmtree(DIR, ignore_errors=True)
    spawn(save_phase)
    print("saved 2x2 (dp,tp) checkpoint to", DIR)
    res = spawn(load_phase)
    ok = True
    for cfg in res[0]:
        per = [res[r][cfg] for r in range(4)]
        good = all("ERROR" not in x and "False" not in x for x in per)
        ok &= good
        print(
            f"load into {cfg:5s}: {'OK' if good else 'FAIL'}  rank0: {per[0]}"
            + ("" if good else f" all: {per}")
        )
    print("ALL OK" if ok else "SOME FAILED")
    sys.exit(0 if ok else 1)
