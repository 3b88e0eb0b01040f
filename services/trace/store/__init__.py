"""Storage of the trace service: the interfaces (base) and their implementations (sql)."""
