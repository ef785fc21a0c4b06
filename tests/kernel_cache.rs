//! Where compiled GPU kernels are kept (`SPIKECUBE_KERNEL_CACHE`): a folder
//! given is made and used, `off` turns the cache off, and a folder that cannot
//! be made is skipped rather than failing the run. One test, so that the
//! variable changes in one thread only.

use spikecube::backend::kernel_cache_dir;

#[test]
fn kernel_cache_follows_the_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kernels");
    // SAFETY: this test binary has one test; nothing else reads the environment meanwhile.
    unsafe { std::env::set_var("SPIKECUBE_KERNEL_CACHE", &dir) };
    assert_eq!(kernel_cache_dir(), Some(dir.clone()));
    assert!(dir.is_dir());
    // The write test leaves nothing behind.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    unsafe { std::env::set_var("SPIKECUBE_KERNEL_CACHE", "off") };
    assert_eq!(kernel_cache_dir(), None);
    // A path under a plain file cannot be a folder.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    unsafe { std::env::set_var("SPIKECUBE_KERNEL_CACHE", file.join("kernels")) };
    assert_eq!(kernel_cache_dir(), None);
    unsafe { std::env::remove_var("SPIKECUBE_KERNEL_CACHE") };
}
