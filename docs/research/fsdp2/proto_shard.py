"""Q1-Q3: FSDP2 (+TP, HSDP) on CPU/gloo; params, grads and Adam state as views
into external flat (memfd) buffers; bitwise comparison with plain FSDP2.

run (from the repository root): python docs/research/fsdp2/proto_shard.py
"""

import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import (
    ExternalStore,
    batch,
    bitwise_equal,
    build,
    dp_rank,
    free_port,
    init_pg,
    local_shards,
    make_mesh,
)
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

STEPS = 5


def run(kind, cfg, mesh, *, foreach, mpp, ext, reshard=True):
    model = build(kind, cfg, mesh, mp=mpp, reshard=reshard)
    store = None
    if ext:
        store = ExternalStore(model)
        store.bind_params()
        store.bind_grads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=foreach)
    if ext:
        store.precreate_adam_state(opt)
    dpr = dp_rank(cfg, mesh)
    losses, viewok = [], []
    for s in range(STEPS):
        x, y = batch(s, dpr)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        if ext:
            viewok.append(store.check_views(grads=True))
        opt.step()
        if ext:
            viewok.append(store.check_views(opt))
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return model, opt, store, losses, viewok


def one(kind, cfg, mesh, foreach, mpp, reshard=True):
    m0, o0, _, l0, _ = run(kind, cfg, mesh, foreach=foreach, mpp=mpp, ext=False, reshard=reshard)
    m1, o1, st, l1, vok = run(kind, cfg, mesh, foreach=foreach, mpp=mpp, ext=True, reshard=reshard)
    s0, s1 = local_shards(m0), local_shards(m1)
    same_loss = all(bitwise_equal(a, b) for a, b in zip(l0, l1, strict=True))
    same_param = all(bitwise_equal(s0[k], s1[k]) for k in s0)
    # optimizer states bitwise equal
    p0 = dict(m0.named_parameters())
    p1 = dict(m1.named_parameters())
    same_state = all(
        bitwise_equal(o0.state[p0[k]][n]._local_tensor, o1.state[p1[k]][n]._local_tensor)
        for k in p0
        for n in ("exp_avg", "exp_avg_sq")
    )
    # the external buffer itself holds the exact bytes of the (plain run's) local shards; padding 0
    buf_ok, pad_zero = True, True
    names = {id(p): k for k, p in m1.named_parameters()}
    for fp, off, n in st.slots.values():
        k = names[id(fp.sharded_param)]
        ext = st.region("param", off, n, fp)
        d = fp.fsdp_placement.dim
        L = fp.sharded_size[d]
        buf_ok &= bitwise_equal(ext.narrow(d, 0, L), s0[k])
        if L < ext.size(d):
            pad_zero &= bool((ext.narrow(d, L, ext.size(d) - L) == 0).all())
    views = {k: all(v[k] for v in vok) for k in ("param", "grad", "state")}
    rs_hits = sum(c.hits for c in st.rs)
    uneven = sum(
        1 for fp, _, _ in st.slots.values() if fp.sharded_size != fp.padded_sharded_param_size
    )
    return dict(
        loss=same_loss,
        params=same_param,
        adam=same_state,
        buf=buf_ok,
        pad0=pad_zero,
        views=views,
        rs_ext_hits=rs_hits,
        uneven_params=uneven,
        last_loss=float(l1[-1]),
    )


def public_bind_attempt(kind, cfg, mesh):
    """Public route: load_state_dict(assign=True) with DTensors over external views.
    FSDP2's post-load hook calls reset_sharded_param(); report which params end up
    with _sharded_param_data inside the external buffer (even shards) or copied (uneven)."""
    model = build(kind, cfg, mesh)
    st = ExternalStore(model)
    sd = {}
    for k, p in model.named_parameters():
        fp, off, n = st.slots[id(p)]
        d = fp.fsdp_placement.dim
        v = st.region("param", off, n, fp).narrow(d, 0, p.to_local().size(d))
        with torch.no_grad():
            v.copy_(p.to_local())
        sd[k] = DTensor.from_local(
            v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    model.load_state_dict(sd, assign=True)
    even_in = uneven_in = even = uneven = 0
    for _, g in [(None, g) for _, g in __import__("common").fsdp_param_groups(model)]:
        for fp in g.fsdp_params:
            ok = st.inside("param", fp._sharded_param_data) and st.inside(
                "param", fp.sharded_param._local_tensor
            )
            if fp.sharded_size == fp.padded_sharded_param_size:
                even += 1
                even_in += ok
            else:
                uneven += 1
                uneven_in += ok
    return f"even {even_in}/{even} in ext buffer, uneven(padded) {uneven_in}/{uneven} in ext buffer"


def worker(rank, world, port, q):
    warnings.filterwarnings("ignore")
    init_pg(rank, world, port)
    torch.set_num_threads(1)
    out = []
    meshes = {c: make_mesh(c) for c in ("2d", "fsdp", "hsdp")}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cases = []
    for kind in ("mlp", "tf"):
        for cfg in ("2d", "fsdp", "hsdp"):
            for foreach in (True, False):
                cases.append((kind, cfg, foreach, None, True))
        cases.append((kind, "2d", True, bf16, True))
        cases.append((kind, "2d", True, None, False))  # reshard_after_forward=False
    for kind, cfg, foreach, mpp, rs in cases:
        tag = f"{kind:3s} {cfg:4s} foreach={foreach!s:5s} mp={'bf16/fp32' if mpp else 'none':9s} reshard={rs!s:5s}"
        try:
            r = one(kind, cfg, meshes[cfg], foreach, mpp, rs)
        except Exception as e:  # noqa
            import traceback

            traceback.print_exc()
            r = f"ERROR {type(e).__name__}: {e}"
        out.append((tag, r))
    try:
        out.append(
            (
                "public load_state_dict(assign=True) tf 2d",
                public_bind_attempt("tf", "2d", meshes["2d"]),
            )
        )
    except Exception as e:
        out.append(("public load_state_dict(assign=True) tf 2d", f"ERROR {type(e).__name__}: {e}"))
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, 4, port, q)) for r in range(4)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=900) for _ in range(4))
    for p in procs:
        p.join()
    allok = True
    for i, (tag, _r) in enumerate(res[0]):
        per = [res[k][i][1] for k in range(4)]
        if isinstance(per[0], dict):
            keys = ("loss", "params", "adam", "buf", "pad0")
            ok = all(all(p[k] for k in keys) and all(p["views"].values()) for p in per)
            allok &= ok
            hits = [p["rs_ext_hits"] for p in per]
            print(
                f"{tag}: {'BITWISE-EQUAL+VIEWS OK' if ok else 'FAIL'}  uneven_per_rank={[p['uneven_params'] for p in per]} "
                f"rs_out_in_ext={hits} loss={per[0]['last_loss']:.6f}" + ("" if ok else f"  {per}")
            )
        else:
            allok &= "ERROR" not in str(per[0])
            print(f"{tag}: {per}")
    print("ALL OK" if allok else "SOME FAILED")
    sys.exit(0 if allok else 1)
