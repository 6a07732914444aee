//! What `UCX_TLS` lets the inner UCX engine use: BOUNCE must not open a same-host path that
//! grants a peer more than the transports UCX was allowed (a CUDA IPC handle maps the whole
//! allocation behind a registration, which UCX exports only with `cuda_ipc` on).
//!
//! UCX's rules (its context's transport list): unset, empty or `all` allows every transport;
//! a list names the transports allowed; a list led by `^` names the ones left out. A name may
//! be an alias of several transports (`cuda`: `cuda_copy`, `cuda_ipc`, `gdr_copy`; `sm` and
//! `shm`: the shared-memory ones, `cma` among them), unless led by `\`, which takes it as a
//! transport's own name; `:aux` after a name only restricts its use, so it is ignored here.

/// The aliases that stand for the transports BOUNCE asks about.
const ALIASES: &[(&str, &[&str])] = &[
    ("cuda", &["cuda_copy", "cuda_ipc", "gdr_copy"]),
    ("sm", &["posix", "sysv", "xpmem", "knem", "cma"]),
    ("shm", &["posix", "sysv", "xpmem", "knem", "cma"]),
];

/// True when a `UCX_TLS` of `value` (`None`: unset) lets UCX use transport `tl`.
pub(crate) fn allows(value: Option<&str>, tl: &str) -> bool {
    let value = value.map(str::trim).unwrap_or_default();
    let (exclude, list) = match value.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    if list.is_empty() {
        // Unset or empty: UCX's default, every transport ("^" alone leaves none out).
        return true;
    }
    let named = list.split(',').map(str::trim).filter(|n| !n.is_empty()).any(|entry| {
        let name = entry.split(':').next().unwrap_or_default();
        match name.strip_prefix('\\') {
            Some(own) => own == tl,
            None => {
                name == tl || name == "all" || ALIASES.iter().any(|(alias, tls)| *alias == name && tls.contains(&tl))
            }
        }
    });
    named != exclude
}

#[cfg(test)]
mod tests {
    use super::allows;

    #[test]
    fn unset_empty_and_all_allow_every_transport() {
        for v in [None, Some(""), Some("  "), Some("all"), Some("^")] {
            assert!(allows(v, "cuda_ipc"), "{v:?}");
        }
    }

    #[test]
    fn a_list_allows_what_it_names_directly_or_through_an_alias() {
        assert!(allows(Some("rc,cuda_copy,cuda_ipc"), "cuda_ipc"));
        assert!(allows(Some("tcp,cuda"), "cuda_ipc"));
        assert!(allows(Some("tcp, sm"), "cma"));
        assert!(allows(Some("cuda_ipc:aux"), "cuda_ipc"));
        assert!(!allows(Some("tcp"), "cuda_ipc"));
        assert!(!allows(Some("tcp,cuda_copy"), "cuda_ipc"));
        assert!(!allows(Some("sm"), "cuda_ipc"));
        // `\` takes the name as a transport's own: no transport is called "cuda".
        assert!(!allows(Some("\\cuda"), "cuda_ipc"));
        assert!(allows(Some("\\cuda_ipc"), "cuda_ipc"));
    }

    #[test]
    fn a_list_led_by_a_caret_leaves_out_what_it_names() {
        assert!(!allows(Some("^cuda_ipc"), "cuda_ipc"));
        assert!(!allows(Some("^cuda"), "cuda_ipc"));
        assert!(!allows(Some("^ib,cuda_ipc"), "cuda_ipc"));
        assert!(allows(Some("^ib,tcp"), "cuda_ipc"));
        assert!(allows(Some("^cuda_copy"), "cuda_ipc"));
        assert!(!allows(Some("^shm"), "cma"));
        // Leaving out "all" is read as leaving out everything (the side that grants less).
        assert!(!allows(Some("^all"), "cuda_ipc"));
    }
}
