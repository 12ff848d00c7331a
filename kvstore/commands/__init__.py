"""Commands: the table (`table`), the one path from parser to handler (`dispatch`), and the
families as Redis groups them (`strings`, `keyspace`, `server`, `kvcache`, ...), listed
in `families`, which builds the table a server hands to dispatch and ACL."""
