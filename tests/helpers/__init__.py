"""Code the tests share, and the job functions their worker processes run.

Job functions live here rather than in test modules: ``LocalFleet`` spawns its workers and pickles
each job by module name, so a job must sit in a module a worker can import without running a test
module's collection-time code. ``tests/`` is on ``sys.path`` (pytest puts the root conftest's folder
there, and spawned workers inherit the parent's path), so workers import these as ``helpers.<module>``.
"""
