"""`python -m mooncake_k8s.cli`: how `mooncake up` and the test harnesses start processes."""

from mooncake_k8s.cli.main import main

main()
