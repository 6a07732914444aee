//! nixl-bounce: the BOUNCE NIXL backend plugin (placeholder while the FFI edge is written).
