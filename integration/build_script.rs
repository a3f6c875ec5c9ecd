//! `scripts/build`, README's first command, where rustup cannot add the
//! `llvm-tools` the profile-guided build needs (offline, or a toolchain not
//! from rustup). The toolchain's programs are stand-ins here that write down
//! how they were called: a real release build would add minutes to the
//! suite, and what is under test is which build the script chooses.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

fn stand_in(bin: &Path, name: &str, body: &str) {
    let path = bin.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn without_llvm_tools_the_build_is_a_plain_release_build_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    let bin = home.join(".cargo/bin");
    // A sysroot as rustup leaves it without llvm-tools: no llvm-profdata.
    let sysroot = dir.path().join("sysroot");
    std::fs::create_dir_all(sysroot.join("lib/rustlib/x86_64-unknown-linux-gnu/bin")).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    let log = dir.path().join("calls");
    let log = log.display();
    stand_in(&bin, "rustc", &format!("echo {}", sysroot.display()));
    stand_in(&bin, "rustup", &format!("echo \"rustup $*\" >> {log}; exit 1"));
    stand_in(&bin, "cargo", &format!("echo \"cargo $*\" >> {log}"));

    let out = Command::new("scripts/build")
        .env("HOME", &home)
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status.code());
    assert!(
        stderr.contains("no llvm-profdata") && stderr.contains("without a profile"),
        "says why the build is not profiled: {stderr}"
    );
    let calls = std::fs::read_to_string(dir.path().join("calls")).unwrap();
    assert_eq!(
        calls.lines().collect::<Vec<_>>(),
        [
            "rustup component add llvm-tools",
            "cargo build --release --locked --bin tollgate"
        ],
        "asked rustup for the tools, then built without a profile"
    );
}
