//! `man/aalis-proxy.1` is generated from the clap definition; this test
//! fails when the committed page is stale. Regenerate with
//! `UPDATE_MAN=1 cargo test --test man`.

use std::io::Write;
use std::path::Path;

use clap_mangen::Man;

/// One `render_*_section` method of [`Man`].
type Section = fn(&Man, &mut dyn Write) -> std::io::Result<()>;

/// Renders the whole page: the top-level command, then one section per
/// subcommand with its synopsis, description, options and examples, then
/// the exit status. No date and nothing build-dependent, so it is
/// byte-stable.
fn render() -> Vec<u8> {
    let mut cmd = aalis_proxy::cli::command();
    cmd.build();
    let after = cmd
        .get_after_long_help()
        .map(|s| s.to_string())
        .unwrap_or_default();
    let (exit_status, environment) = after
        .split_once("\n\nEnvironment:\n")
        .expect("the top-level long help ends with an Environment block");
    let top = cmd.clone().after_long_help(None::<&str>);
    let man = Man::new(top);
    let mut out = Vec::new();
    // No SUBCOMMANDS section: it would point to per-command pages that do
    // not exist; each command has its own section below instead.
    let sections: [Section; 4] = [
        Man::render_title,
        Man::render_name_section,
        Man::render_synopsis_section,
        Man::render_description_section,
    ];
    for section in sections {
        section(&man, &mut out).expect("render to memory");
    }
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let name = format!("aalis-proxy {}", sub.get_name());
        writeln!(out, ".SH \"{}\"", name.to_uppercase().replace('-', "\\-")).expect("write");
        let examples = sub.get_after_long_help().map(|s| s.to_string());
        let sub_man = Man::new(sub.clone().after_long_help(None::<&str>));
        let sections: [Section; 3] = [
            Man::render_synopsis_section,
            Man::render_description_section,
            Man::render_options_section,
        ];
        let mut body = Vec::new();
        for section in sections {
            section(&sub_man, &mut body).expect("render to memory");
        }
        // Subsections of the command's section, not top-level ones.
        let mut body = String::from_utf8(body)
            .expect("roff is UTF-8")
            .replace(".SH ", ".SS ");
        // clap_mangen drops the `...` of a positional that takes several
        // values, which `--help` shows in its usage line and argument
        // list; put it back in both.
        for name in repeatable_positionals(sub) {
            let bare = format!("[\\fI{name}\\fR]");
            body = body.replace(&bare, &format!("{bare}..."));
        }
        out.extend_from_slice(body.as_bytes());
        if let Some(examples) = examples {
            verbatim(&mut out, &examples);
        }
    }
    writeln!(out, ".SH \"EXIT STATUS\"").expect("write");
    verbatim(&mut out, exit_status.trim_start_matches("Exit status:\n"));
    writeln!(out, ".SH ENVIRONMENT").expect("write");
    verbatim(&mut out, environment);
    out
}

/// The value names of `cmd`'s positional arguments that take more than one
/// value (`[CAPTURE]...` in its usage line).
fn repeatable_positionals(cmd: &clap::Command) -> Vec<String> {
    cmd.get_positionals()
        .filter(|arg| arg.get_num_args().is_some_and(|n| n.max_values() > 1))
        .map(|arg| match arg.get_value_names() {
            Some(names) => names.join(" "),
            None => arg.get_id().as_str().to_owned(),
        })
        .collect()
}

/// A preformatted block, escaped for roff.
fn verbatim(out: &mut Vec<u8>, text: &str) {
    writeln!(out, ".PP\n.nf").expect("write");
    for line in text.lines() {
        let line = line.replace('\\', "\\e").replace('-', "\\-");
        let line = if line.starts_with('.') || line.starts_with('\'') {
            format!("\\&{line}")
        } else {
            line
        };
        writeln!(out, "{line}").expect("write");
    }
    writeln!(out, ".fi").expect("write");
}

#[test]
fn man_page_is_up_to_date() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("man/aalis-proxy.1");
    let fresh = render();
    if std::env::var_os("UPDATE_MAN").is_some() {
        std::fs::write(&path, &fresh).expect("write man/aalis-proxy.1");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    if committed != fresh {
        let old = String::from_utf8_lossy(&committed);
        let new = String::from_utf8_lossy(&fresh);
        let diff = similar::TextDiff::from_lines(old.as_ref(), new.as_ref())
            .unified_diff()
            .header("man/aalis-proxy.1 (committed)", "generated")
            .to_string();
        panic!("man/aalis-proxy.1 is stale; run `UPDATE_MAN=1 cargo test --test man`\n{diff}");
    }
}

#[test]
fn man_page_documents_every_annotate_flag() {
    let page = String::from_utf8(render()).expect("roff is UTF-8");
    for flag in [
        "\\-\\-format",
        "\\-\\-inject",
        "\\-\\-session",
        "EXIT STATUS",
    ] {
        assert!(page.contains(flag), "man page lacks {flag}");
    }
}

#[test]
fn man_page_synopses_are_the_usage_lines_of_help() {
    let page = String::from_utf8(render()).expect("roff is UTF-8");
    let mut cmd = aalis_proxy::cli::command();
    cmd.build();
    let mut checked = 0;
    for sub in cmd.get_subcommands_mut().filter(|s| s.get_name() != "help") {
        let usage = sub.render_usage().to_string();
        for name in repeatable_positionals(sub) {
            assert!(usage.contains(&format!("[{name}]...")), "{usage}");
            // The synopsis and the argument's own entry, as in `--help`.
            assert_eq!(
                page.matches(&format!("[\\fI{name}\\fR]...")).count(),
                2,
                "the man page lacks [{name}]... in its synopsis or argument list"
            );
            assert_eq!(page.matches(&format!("[\\fI{name}\\fR]")).count(), 2);
            checked += 1;
        }
    }
    assert_eq!(
        checked, 1,
        "mock's [CAPTURE]... is the one repeatable argument"
    );
}

#[test]
fn man_page_has_an_environment_section_like_help() {
    let page = String::from_utf8(render()).expect("roff is UTF-8");
    let env = page
        .split_once(".SH ENVIRONMENT\n")
        .expect("an ENVIRONMENT section")
        .1;
    for name in [
        "RUST_LOG",
        "NO_COLOR",
        "TERM",
        "_RJEM_MALLOC_CONF",
        "HTTPS_PROXY",
    ] {
        assert!(env.contains(name), "ENVIRONMENT lacks {name}");
    }
}
