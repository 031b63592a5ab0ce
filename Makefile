# The README's two commands: `make serve` and `make test`.
.PHONY: setup serve test clean

setup:
	bash scripts/setup.sh

serve: setup
	.venv/bin/loraplex serve $(ARGS)

test:
	bash scripts/setup.sh --test
	bash scripts/test.sh $(ARGS)

clean:
	rm -rf .venv loraplex/v1 .pytest_cache
