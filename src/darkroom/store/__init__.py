"""The stores: PostgreSQL (SQL constants and one function per query, schema.sql) and object
storage (S3 or a local folder). Each adapter translates its driver's errors at the edge."""
