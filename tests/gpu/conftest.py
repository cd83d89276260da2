"""The GPU tests run inside a GPU call's time bound (benchmarks/gpu_call.sh), which kills pytest
when it runs out; pytest writes a failure's report only in its summary at the end, so a run cut
short showed an F and nothing of why. Each failure's report is written as soon as the test fails."""

import sys


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-6000:]}\n")
        sys.stderr.flush()
