------------------------------- MODULE Replay -------------------------------
(***************************************************************************)
(* The step in flight, replayed in parallel (PROTOCOL.md, "The step in     *)
(* flight, replayed in parallel"; leto/core/replay.py).                    *)
(*                                                                         *)
(* A death before the vote loses rank Owner's compute of the step in       *)
(* flight.  Its share is K micro-batches; its own backward passes would    *)
(* have accumulated their gradients as g = ((g1 + g2) + g3) ..., each gi   *)
(* computed from the parameters of the step the recovery resumed at (S)    *)
(* and, where the compute draws random numbers, from Owner's RNG stream.   *)
(* Leto.tla's Compute(r) is that whole computation as one action; here it  *)
(* is opened up: micro-batch i is computed by rank Computer(i) of the new  *)
(* generation, sent to Owner, and added there.                            *)
(*                                                                         *)
(* A gradient is modelled by what determines its bytes: [mb, params, rng]  *)
(* (the micro-batch, the parameters' version it was computed from, whose   *)
(* RNG stream it drew from, "none" if it drew nothing).  Floating-point    *)
(* addition is not associative, so a sum is modelled by the sequence of    *)
(* its additions: two sums are bitwise equal when their sequences are.     *)
(*                                                                         *)
(* Mutants: "out_of_order" adds the micro-batches as they arrive;          *)
(* "own_rng" replays a compute that draws random numbers (each computer    *)
(* draws from its own stream); "stale_params" lets a survivor compute      *)
(* before the recovery resumed (its parameters not yet those of S).        *)
(* Each violates ReplayOK (MCReplay_<mutant>.cfg).                         *)
(***************************************************************************)
EXTENDS Naturals, Sequences

CONSTANTS W, K, Owner, S, Mutant

ASSUME W \in Nat \ {0} /\ K \in Nat \ {0} /\ Owner \in 0..(W - 1) /\ S \in Nat
ASSUME Mutant \in {"none", "out_of_order", "own_rng", "stale_params"}

Ranks == 0..(W - 1)
MBs == 1..K
NONE == [mb |-> 0, params |-> 0, rng |-> "none"]

VARIABLES
    draws,     \* the compute draws random numbers (chosen at Init: both checked)
    resumed,   \* the recovery resumed: every rank's parameters are those of S
    params,    \* params[r]: the version of the parameters rank r computes from
    sent,      \* sent[i]: micro-batch i's gradient, sent to Owner (NONE: not yet)
    acc        \* Owner's additions so far, in order

vars == <<draws, resumed, params, sent, acc>>

\* The core's plan (leto.core.replay.replay_plan): micro-batch i (from 1) to rank
\* (Owner + i - 1) mod W; none where the compute draws (the backend refuses the
\* replay: Owner computes every micro-batch alone, the serial path)
Replays == ~draws \/ Mutant = "own_rng"
Computer(i) == IF Replays THEN (Owner + i - 1) % W ELSE Owner

\* What Owner's own backward passes would have summed
Reference == [j \in MBs |-> [mb |-> j, params |-> S,
                             rng |-> IF draws THEN Owner ELSE "none"]]

Init ==
    /\ draws \in BOOLEAN
    /\ resumed = FALSE
    \* during the reconcile a survivor's parameters may still be rewritten (a roll
    \* back or forward): modelled as a version other than S
    /\ params = [r \in Ranks |-> IF r = Owner THEN S ELSE S + 1]
    /\ sent = [i \in MBs |-> NONE]
    /\ acc = <<>>

Resume ==
    /\ ~resumed
    /\ resumed' = TRUE
    /\ params' = [r \in Ranks |-> S]
    /\ UNCHANGED <<draws, sent, acc>>

ComputeMB(i) ==
    LET r == Computer(i) IN
    /\ resumed \/ Mutant = "stale_params"
    /\ sent[i] = NONE
    /\ sent' = [sent EXCEPT ![i] = [mb |-> i, params |-> params[r],
                                    rng |-> IF draws THEN r ELSE "none"]]
    /\ UNCHANGED <<draws, resumed, params, acc>>

\* Owner adds micro-batch i: the next in order (the mutant: any that arrived)
Add(i) ==
    /\ sent[i] /= NONE
    /\ \A j \in 1..Len(acc) : acc[j].mb /= i
    /\ IF Mutant = "out_of_order" THEN TRUE ELSE i = Len(acc) + 1
    /\ acc' = Append(acc, sent[i])
    /\ UNCHANGED <<draws, resumed, params, sent>>

Done ==
    /\ Len(acc) = K
    /\ UNCHANGED vars

Next == Resume \/ (\E i \in MBs : ComputeMB(i) \/ Add(i)) \/ Done

Spec == Init /\ [][Next]_vars /\ WF_vars(Next)

TypeOK ==
    /\ draws \in BOOLEAN /\ resumed \in BOOLEAN
    /\ Len(acc) <= K

\* The sum Owner builds is, addition by addition, the one its own backward passes
\* would have built: bitwise its gradient
ReplayOK == \A j \in 1..Len(acc) : acc[j] = Reference[j]

\* The replay ends (every micro-batch added)
Completes == <>(Len(acc) = K)
=============================================================================
