"""Names of the profiler ranges the recorder's structure and timing passes leave in a capture
(read back by vsim.record.assemble and vsim.record.timing)."""

ITERATION = "vsim::iteration"
BACKWARD = "vsim::backward"
MODULE = "vsim::m::"
DISPATCH = "vsim::d#"
SAVE = "vsim::s#"
UNPACK = "vsim::u#"
GRAD = "vsim::g#"
