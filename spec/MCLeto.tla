------------------------------- MODULE MCLeto -------------------------------
(***************************************************************************)
(* Model-checking instance of Leto: ranks r1, r2 on node n1 and r3 on n2.  *)
(* The constants NChunks, MaxStep, MaxFaults, K and Mutant come from the   *)
(* .cfg files.  MCConstraint is the state constraint of MCLeto.cfg and     *)
(* MCLetoSmall.cfg; spec/README.md says why it keeps the Progress check    *)
(* exact on the states it explores and what it leaves out.                 *)
(***************************************************************************)
EXTENDS Leto

MCRanks == {"r1", "r2", "r3"}
MCNodes == {"n1", "n2"}
MCNodeOf == [r \in MCRanks |-> IF r = "r3" THEN "n2" ELSE "n1"]

\* How far rank r is in the training loop (used to break the r1/r2 symmetry):
\* a rank in the loop tail of step s is past every point of step s's
\* transaction and before the close of s.
Pos(r) ==
    LET sub(c) == IF data[r][c] = step[r] + 1
                  THEN IF undo[r][c] = NONE THEN 3 ELSE 2
                  ELSE IF data[r][c] = TORN THEN 1 ELSE 0
        pcv == CASE pc[r] = "IDLE" -> 0 [] pc[r] = "COMPUTED" -> 1
                 [] pc[r] = "REDUCED" -> 2 [] OTHER -> 3
    IN  IF pc[r] = "TAIL" THEN step[r] * 20 - 1
        ELSE step[r] * 20 + pcv + sub(1) + sub(2)

\* Only r1's shadow is ever reclaimed (COLD), and only in behaviours with at
\* most one fault; a promoted rank's new shadow is warmed after Resume.
CShadow ==
    /\ \A r \in Ranks : shadow[r] = "COLD" => r = "r1" /\ faults <= 1
    /\ \A r \in promoted : trainer[r] = "ALIVE" => shadow[r] = NONE

\* The agent kills a stale process at once: before its rank is promoted.
CStale == \A r \in Ranks : stale[r] => phase = "PROMOTING" /\ trainer[r] = "DEAD"

\* While running, ranks apply their chunks one rank at a time.
CApply == phase = "RUNNING" =>
            Cardinality({r \in Ranks : pc[r] = "APPLYING"}) <= 1

\* After a recovery, only the resumed state itself is explored in RUNNING.
CAfter == phase = "RUNNING" /\ gen > 0 =>
            \A r \in Ranks : step[r] = committed /\ pc[r] = "IDLE"

\* Before any fault, r1 is never behind r2 (they are symmetric on node n1).
CSym == phase = "RUNNING" /\ faults = 0 => Pos("r1") >= Pos("r2")

MCConstraint == CShadow /\ CStale /\ CApply /\ CAfter /\ CSym

\* The lighter constraint of MCLetoDeep.cfg (safety only): shadows and
\* symmetry as above, stale processes live as long as they like, two ranks
\* of which one is dead may be mid-apply together, and a resumed run may
\* compute, reduce and prepare its next step.
MCDeepConstraint ==
    /\ CShadow
    /\ CSym
    /\ phase = "RUNNING" =>
          Cardinality({r \in Ranks : pc[r] = "APPLYING" /\ trainer[r] = "ALIVE"}) <= 1
    /\ phase = "RUNNING" /\ gen > 0 =>
          \A r \in Ranks : step[r] = committed /\ pc[r] # "APPLYING"
=============================================================================
