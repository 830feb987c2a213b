"""Hot sessions of one worker: residency, snapshots, rollback and replay, guards, batching,
and moving them to other workers.

``manager``          ``SessionManager``: the session operations the API calls
``session``          one resident session (state, step, history, lease) and its queue
``residency``        the resident sessions, whether each is still ours (fenced writes), and
                     their unlogged inputs flushed
``loading``          sessions into memory and out: load, unload, park, idle eviction
``migration``        ``Migrator``: hand-offs to other workers, Migrate, Drain, placed forks
``handoff``          ``HandOff``: one hand-off driven start to finish (snapshot, reserve,
                     adopt, drop or take back)
``rebalance``        sessions spread over the workers as they join (hand-offs)
``replay``           the one rebuild: the newest snapshot at or before a step, plus replay
``lifecycle``        sessions born and ended: create, fork, import, close, export
``intake``           a stream's steps checked and queued as runs (a step sent alone: a run of one)
``stepper``          queued steps of many sessions run as batches: plan, log, execute, settle
``batch_plan``       what a batch does with each queued step, decided before it runs
``batch_work``       what a batch did to one session, and its answers
``log_ahead``        a batch's log appends sent before its engine calls
``checkpoints``      snapshots of resident sessions, encoded and committed
``snapshot_writer``  periodic checkpoints encoded and written off the hot path
``snapshot_commits``  snapshot commits that come due together sent to Redis together
``forecaster``       forecasts of many sessions batched per engine call
``generation``       Generate: a prompt fed, then seeded draws fed back, through the intake
``sampling``         a token drawn from logits: greedy, or keyed by (seed, step) with filters
``logits``           penalties and logit bias over the session's recent inputs; logprobs
``stopping``         a generation's text released: stop strings (held-back text), EOS
``handover``         tokens handed to the client one at a time; a cancelled call's step
                     taken back
``constraints``      constrained output: a JSON schema, regex or grammar's mask (llguidance)
``text_monitor``     a check of the output text that retracts and resamples on a rejection
``guided_output``    a generation's constraint and monitor at work, draw by draw
``history``          ``HistoryReader``: what a session did over a range of steps
``guards``           guard rules (FINITE, RANGE, RATE, PREDICTION_ERROR; sustained) and
                     their actions; the checks of one output row
``stateful_guards``  guards that carry state from step to step (input checks, RATE,
                     sustained): one step judged, and the guard state after it
``guarded_replay``   a replay that judges every logged step again (imputes as live)
``events``           ``SessionEvent``: rollbacks and guard events kept in the store
``config``           per-session settings (durability, snapshot period, guards, idle TTL)
``records``          what session operations take and give back (values only)
``models``           ``ServedModels``: the served models by name and version
``model_lanes``      each served model's engine lane, stepper and forecaster
``memory``           ``WorkerMemory``: one memory budget for everything large
``store_resets``     the sessions a wiped or replaced store took with it
``locks_while_used``  a lock per key that exists only while in use
``errors``           typed errors of session operations

Imports: ``cluster`` (ownership, and ``peers`` for the hand-off's call to its target),
``state`` and ``engine``; never gRPC itself.
"""
