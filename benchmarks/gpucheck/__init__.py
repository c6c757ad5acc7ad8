"""The parts of ``benchmarks/gpu_check.py`` by role: the case matrix and its engines (``cases``), the checks of each
family (``grad_checks``, ``family_checks``), one case on one rank (``case_run``), ranks sharing one device
(``ranks``, ``rank_deaths``, ``probe``), timings against floors (``floors``, ``timings``, ``checkpoint_timing``,
``profiling``, ``budget``), the report (``report``) and the command line (``cli``)."""
