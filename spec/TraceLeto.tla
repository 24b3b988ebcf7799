------------------------------ MODULE TraceLeto ------------------------------
(***************************************************************************)
(* Trace validation of a real run against the spec, as CCF's               *)
(* Traceccfraft.tla does for its Raft: the events a backend fed the core's *)
(* model (RUN_DIR/events.jsonl, expanded to the spec's actions by          *)
(* leto.spec.tlatrace into the module TraceData) must be a behaviour of    *)
(* Leto, one action per event, in order.                                   *)
(*                                                                         *)
(* TraceNext takes the action the trace names next, if the spec enables    *)
(* it.  The whole trace replays when TLC finds a state with ti past its    *)
(* end (the invariant TraceUnfinished is "violated": that is the pass); it *)
(* diverges where TLC finds a deadlock instead, at event ti.               *)
(*                                                                         *)
(* One step is not the spec's: Adopt, the retained state the trainers      *)
(* report during RECONCILING replacing the model's picture of memory       *)
(* (leto/core/adopt.py, PROTOCOL.md "Adopting the retained state").  The   *)
(* Python replay (leto spec trace) checks that the model could have come   *)
(* to it; here it is taken as reported, and every invariant is checked on  *)
(* what follows.                                                           *)
(***************************************************************************)
EXTENDS Leto, Sequences, TraceData

VARIABLE ti   \* the trace's next event

TraceInitShadow == NONE

Adopt(e) ==
    /\ phase = "RECONCILING"
    /\ data' = e.data /\ undo' = e.undo /\ grad' = e.grad
    /\ par' = e.par /\ gpar' = e.gpar /\ t2' = e.t2 /\ t2lost' = e.t2lost
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, shadow, stale, gen, phase,
                   committed, prepared, faults, target, kind, loss, mlost,
                   nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

Do(e) ==
    CASE e.a = "Compute" -> Compute(e.r)
      [] e.a = "Reduce" -> Reduce(e.r)
      [] e.a = "Prepare" -> Prepare(e.r)
      [] e.a = "Decide" -> Decide
      [] e.a = "BeginChunk" -> BeginChunk(e.r, e.c)
      [] e.a = "EndChunk" -> EndChunk(e.r, e.c)
      [] e.a = "ParityChunk" -> ParityChunk(e.r, e.c)
      [] e.a = "Finish" -> Finish(e.r)
      [] e.a = "Close" -> Close(e.r)
      [] e.a = "Tier2Snapshot" -> Tier2Snapshot
      [] e.a = "BeginCheckpoint" -> BeginCheckpoint
      [] e.a = "WriteShard" -> WriteShard(e.r)
      [] e.a = "CheckpointDurable" -> CheckpointDurable
      [] e.a = "ShadowWarm" -> ShadowWarm(e.r)
      [] e.a = "ShadowReclaim" -> ShadowReclaim(e.r)
      [] e.a = "Crash" -> Crash(e.r)
      [] e.a = "Hang" -> Hang(e.r)
      [] e.a = "LoseMemory" -> LoseMemory(e.r)
      [] e.a = "LoseNode" -> LoseNode(e.n)
      [] e.a = "StaleWrite" -> StaleWrite(e.r, e.c)
      [] e.a = "Detect" -> Detect
      [] e.a = "Fence" -> Fence
      [] e.a = "Promote" -> Promote(e.r)
      [] e.a = "EndPromote" -> EndPromote
      [] e.a = "Reconcile" -> Reconcile
      [] e.a = "GoFallback" -> GoFallback
      [] e.a = "RestoreCheckpoint" -> RestoreCheckpoint
      [] e.a = "Rebuild" -> Rebuild
      [] e.a = "Resume" -> Resume
      [] e.a = "GiveUp" -> GiveUp
      [] e.a = "Adopt" -> Adopt(e)

TraceInit == Init /\ ti = 1

TraceNext ==
    /\ ti <= Len(Trace)
    /\ Do(Trace[ti])
    /\ ti' = ti + 1

TraceSpec == TraceInit /\ [][TraceNext]_<<vars, ti>>

\* "Violated" exactly when the whole trace has replayed: the pass.
TraceUnfinished == ti <= Len(Trace)
=============================================================================
