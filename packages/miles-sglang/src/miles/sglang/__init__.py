"""SGLang's HTTP protocol in Miles: `miles serve` (Miles' torch engine behind SGLang's native
endpoints). The protocol's field lists are `miles.sglang.protocol`."""
