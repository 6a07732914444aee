//! No import cycles between the modules of `bounce-proto` (issue 9): dependencies inside the
//! core point one way (endpoint -> roles -> event, scheduler, wire, plan -> config -> types).
//!
//! The checker reads every `.rs` file under `src/`, drops comments and string literals, and
//! collects each module's references to other modules of the crate: `use crate::..`,
//! `use super::..`, `use self::..` trees and inline `crate::a::b` paths. A path names the
//! deepest module it reaches (`crate::wire::codec::Reader` -> `wire::codec`, `crate::wire::Msg`
//! -> `wire`). Inline `mod name { .. }` blocks (the `#[cfg(test)] mod tests` at the bottom of a
//! file, `wire::fuzzing`) are modules of their own, so a test module may use another module's
//! test fixtures without that counting against the production modules. `mod x;` declarations
//! are not edges: a parent declaring its children is not a use of them, but a parent that
//! re-exports a child (`pub use frame::Frame`) is, and then the child must not `use super::..`
//! back (it names its sibling, `super::codec::Reader`, instead).
//!
//! Set `BOUNCE_MODULE_CYCLES_SRC=/path/to/src` to check another tree (for example the crate
//! at an older commit, which this test reports as cyclic).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path (`""` for the crate root, `"wire::codec"`) -> the modules it references.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// Removes `//` and `/* */` comments and the contents of string and char literals, keeping
/// line structure irrelevant: the result is only scanned for paths and braces.
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            b'r' if b.get(i + 1) == Some(&b'#') || (b.get(i + 1) == Some(&b'"') && !ident_before(b, i)) => {
                // Raw string r"..", r#".."#: skip to the matching closing quote and hashes.
                let mut j = i + 1;
                let mut hashes = 0;
                while b.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                j += 1;
                loop {
                    if j >= b.len() {
                        break;
                    }
                    if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                out.push_str("\"\"");
                i = j;
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            // A char literal ('x', '\n', '{'), not a lifetime ('a): its closing quote is near.
            b'\'' if b.get(i + 2) == Some(&b'\'') || (b.get(i + 1) == Some(&b'\\')) => {
                i += 1;
                while i < b.len() && b[i] != b'\'' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("' '");
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Expands a `use` tree (`crate::{a::X, b::{self, Y}}`) into its leaf paths.
fn expand_use(tree: &str) -> Vec<String> {
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let mut out = Vec::new();
    expand_into("", &tree, &mut out);
    out
}

fn expand_into(prefix: &str, tree: &str, out: &mut Vec<String>) {
    match tree.find('{') {
        None => out.push(format!("{prefix}{tree}")),
        Some(open) => {
            let head = format!("{prefix}{}", &tree[..open]);
            let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
            let mut depth = 0;
            let mut start = 0;
            for (k, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand_into(&head, &inner[start..k], out);
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            if start < inner.len() {
                expand_into(&head, &inner[start..], out);
            }
        }
    }
}

/// The module a path used inside module `here` names: the deepest known module on it.
/// `None` for paths outside the crate (`std::..`, external crates, plain local names).
fn resolve(here: &str, path: &str, modules: &BTreeSet<String>) -> Option<String> {
    let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let mut base: Vec<String> = match segs.first() {
        Some(&"crate") => {
            segs.remove(0);
            Vec::new()
        }
        Some(&"self") => {
            segs.remove(0);
            here.split("::").filter(|s| !s.is_empty()).map(str::to_owned).collect()
        }
        Some(&"super") => {
            let mut b: Vec<String> = here.split("::").filter(|s| !s.is_empty()).map(str::to_owned).collect();
            while segs.first() == Some(&"super") {
                segs.remove(0);
                b.pop();
            }
            b
        }
        // A bare path that starts with a child module (`pub use frame::Frame` in `wire`).
        Some(first) => {
            let child = if here.is_empty() { (*first).to_owned() } else { format!("{here}::{first}") };
            if !modules.contains(&child) {
                return None;
            }
            here.split("::").filter(|s| !s.is_empty()).map(str::to_owned).collect()
        }
        None => return None,
    };
    for s in segs {
        let mut next = base.clone();
        next.push(s.to_owned());
        if modules.contains(&next.join("::")) {
            base = next;
        } else {
            break;
        }
    }
    Some(base.join("::"))
}

/// Splits one stripped file of module `module` into inline `mod name { .. }` blocks (recursive)
/// and the rest; returns `(module path, code)` pairs.
fn split_inline_mods(module: &str, code: &str) -> Vec<(String, String)> {
    let mut parts = Vec::new();
    let mut own = String::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if starts_word(&chars, i, "mod") {
            let mut j = i + 3;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            let name_start = j;
            while j < chars.len() && is_ident(chars[j]) {
                j += 1;
            }
            let name: String = chars[name_start..j].iter().collect();
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            if !name.is_empty() && chars.get(j) == Some(&'{') {
                let mut depth = 0;
                let mut k = j;
                while k < chars.len() {
                    match chars[k] {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    k += 1;
                }
                let inner: String = chars[j + 1..k.min(chars.len())].iter().collect();
                let child = if module.is_empty() { name } else { format!("{module}::{name}") };
                parts.extend(split_inline_mods(&child, &inner));
                i = k + 1;
                continue;
            }
        }
        own.push(chars[i]);
        i += 1;
    }
    parts.push((module.to_owned(), own));
    parts
}

fn starts_word(chars: &[char], i: usize, word: &str) -> bool {
    let w: Vec<char> = word.chars().collect();
    chars[i..].starts_with(&w)
        && (i == 0 || !is_ident(chars[i - 1]))
        && chars.get(i + w.len()).is_none_or(|c| !is_ident(*c))
}

/// The paths module code references: every `use` tree, and every inline `crate::`/`super::`
/// path outside them.
fn referenced_paths(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut paths = Vec::new();
    let mut rest = String::new();
    let mut i = 0;
    while i < chars.len() {
        if starts_word(&chars, i, "use") {
            let end = chars[i..].iter().position(|&c| c == ';').map_or(chars.len(), |p| i + p);
            let tree: String = chars[i + 3..end].iter().collect();
            paths.extend(expand_use(&tree));
            i = end + 1;
            continue;
        }
        rest.push(chars[i]);
        i += 1;
    }
    let rc: Vec<char> = rest.chars().collect();
    for start in 0..rc.len() {
        for root in ["crate::", "super::"] {
            if starts_word(&rc, start, root.trim_end_matches(':'))
                && rc[start..].starts_with(&root.chars().collect::<Vec<_>>())
            {
                let end = (start..rc.len()).find(|&k| !(is_ident(rc[k]) || rc[k] == ':')).unwrap_or(rc.len());
                paths.push(rc[start..end].iter().collect());
            }
        }
    }
    paths
}

/// Builds the module graph of a crate from `(file path relative to src/, contents)` pairs.
fn graph(files: &[(String, String)]) -> Graph {
    let file_module = |rel: &str| -> String {
        let rel = rel.trim_end_matches(".rs");
        let rel = rel.strip_suffix("/mod").unwrap_or(rel);
        if rel == "lib" { String::new() } else { rel.replace('/', "::") }
    };
    let mut parts = Vec::new();
    for (rel, src) in files {
        parts.extend(split_inline_mods(&file_module(rel), &strip(src)));
    }
    let modules: BTreeSet<String> = parts.iter().map(|(m, _)| m.clone()).collect();
    let mut g = Graph::new();
    for (module, code) in &parts {
        let deps = g.entry(module.clone()).or_default();
        for path in referenced_paths(code) {
            match resolve(module, &path, &modules) {
                Some(target) if target != *module => {
                    deps.insert(target);
                }
                _ => {}
            }
        }
    }
    g
}

/// One cycle of the graph, as the modules along it, or `None` when it is acyclic.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(g: &Graph, m: &str, marks: &mut BTreeMap<String, Mark>, stack: &mut Vec<String>) -> Option<Vec<String>> {
        match marks.get(m) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let at = stack.iter().position(|s| s == m).unwrap_or(0);
                let mut cycle = stack[at..].to_vec();
                cycle.push(m.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(m.to_owned(), Mark::Open);
        stack.push(m.to_owned());
        for d in g.get(m).into_iter().flatten() {
            if let Some(c) = visit(g, d, marks, stack) {
                return Some(c);
            }
        }
        stack.pop();
        marks.insert(m.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    g.keys().find_map(|m| visit(g, m, &mut marks, &mut Vec::new()))
}

fn read_tree(root: &Path) -> Vec<(String, String)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
        let mut entries: Vec<_> =
            std::fs::read_dir(dir).expect("readable src dir").map(|e| e.unwrap().path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(root, &p, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
                out.push((rel, std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

fn show(cycle: &[String]) -> String {
    cycle.iter().map(|m| if m.is_empty() { "crate" } else { m }).collect::<Vec<_>>().join(" -> ")
}

#[test]
fn the_core_has_no_module_cycles() {
    let src = std::env::var("BOUNCE_MODULE_CYCLES_SRC")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/src").to_owned());
    let files = read_tree(Path::new(&src));
    assert!(files.len() > 5, "no sources under {src}");
    let g = graph(&files);
    if let Some(cycle) = find_cycle(&g) {
        panic!("import cycle: {}", show(&cycle));
    }
    // The checker sees the edges it must (an empty graph would be acyclic too).
    for (from, to) in [("endpoint", "sender"), ("receiver", "scheduler"), ("sender", "wire"), ("plan", "config")] {
        assert!(g.get(from).is_some_and(|d| d.contains(to)), "missing edge {from} -> {to}: {g:#?}");
    }
}

fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(p, s)| ((*p).to_owned(), (*s).to_owned())).collect()
}

#[test]
fn a_planted_cycle_through_a_use_tree_is_found() {
    let g = graph(&files(&[
        ("lib.rs", "pub mod a; pub mod b; pub mod c;"),
        ("a.rs", "use crate::{b::{self, B}, types::X};"),
        ("b.rs", "use std::fmt;\nuse crate::c::C;"),
        ("c.rs", "// use crate::b::B; (a comment is no edge)\npub fn f() { crate::a::g() }"),
    ]));
    assert_eq!(g["a"], BTreeSet::from(["b".to_owned(), String::new()]));
    assert_eq!(g["c"], BTreeSet::from(["a".to_owned()]));
    assert_eq!(find_cycle(&g).map(|c| show(&c)).as_deref(), Some("a -> b -> c -> a"));
}

#[test]
fn a_child_using_its_re_exporting_parent_is_a_cycle_but_a_sibling_is_not() {
    let cyclic = graph(&files(&[
        ("wire/mod.rs", "mod codec; mod frame; pub use frame::Frame;"),
        ("wire/frame.rs", "use super::Reader;"),
        ("wire/codec.rs", "pub struct Reader;"),
    ]));
    assert_eq!(find_cycle(&cyclic).map(|c| show(&c)).as_deref(), Some("wire -> wire::frame -> wire"));
    let fine = graph(&files(&[
        ("wire/mod.rs", "mod codec; mod frame; pub use frame::Frame;"),
        ("wire/frame.rs", "use super::codec::Reader; fn f() { let s = \"crate::wire\"; }"),
        ("wire/codec.rs", "pub struct Reader;"),
    ]));
    assert_eq!(fine["wire::frame"], BTreeSet::from(["wire::codec".to_owned()]));
    assert_eq!(find_cycle(&fine), None);
}

#[test]
fn inline_test_modules_are_their_own_nodes() {
    let g = graph(&files(&[
        ("endpoint.rs", "use crate::sender::S;\n#[cfg(test)]\nmod tests { use super::*; pub(crate) fn fx() {} }"),
        ("sender.rs", "pub struct S;\n#[cfg(test)]\nmod tests { use crate::endpoint::tests::fx; }"),
    ]));
    assert_eq!(g["sender::tests"], BTreeSet::from(["endpoint::tests".to_owned()]));
    assert_eq!(g["endpoint::tests"], BTreeSet::from(["endpoint".to_owned()]));
    assert_eq!(find_cycle(&g), None);
    // The same reference from the production code of `sender` closes a cycle.
    let g = graph(&files(&[("endpoint.rs", "use crate::sender::S;"), ("sender.rs", "use crate::endpoint::E;")]));
    assert!(find_cycle(&g).is_some());
}
