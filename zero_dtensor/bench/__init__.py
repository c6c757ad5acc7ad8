"""The benchmark: ``python -m zero_dtensor.bench`` (:mod:`.cli`), its tensor-count sweep (:mod:`.sweep`), the
redistribution rows (:mod:`.redistribute`), the masters' and optimizer state's rows (:mod:`.families`), the floors
(:mod:`.floors`), the tables (:mod:`.table`), the model (:mod:`.model`) and what they share (:mod:`.common`).

Not imported by the library; it prints (rich tables and progress), which library code never does.
"""
