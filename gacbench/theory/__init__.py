"""The bounded-staleness theory of gacbench. Statements and proofs: theory/README.md."""
