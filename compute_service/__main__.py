"""`python -m compute_service`: Run the GPU compute service (loraplex.v1.Compute)."""
import sys

from loraplex.cli._service import service_main

if __name__ == "__main__":
    sys.exit(service_main("compute_service", "ComputeConfig", "Run the GPU compute service (loraplex.v1.Compute)."))
