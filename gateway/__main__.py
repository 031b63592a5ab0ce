"""`python -m gateway`: Run the public gateway (loraplex.v1.Gateway)."""
import sys

from loraplex.cli._service import service_main

if __name__ == "__main__":
    sys.exit(service_main("gateway", "GatewayConfig", "Run the public gateway (loraplex.v1.Gateway)."))
