"""One module per public wire format: its request structs, its job builder and its renderer."""
