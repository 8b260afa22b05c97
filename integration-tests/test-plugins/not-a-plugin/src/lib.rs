//! Test fixture for the plugin loader: a plain cdylib exporting one C function and no abi_stable
//! library header, so loading it as a plugin must fail with "not a plugin".

/// The only export: `a + b` (wrapping).
#[no_mangle]
pub extern "C" fn add(a: i32, b: i32) -> i32 {
    a.wrapping_add(b)
}

#[cfg(test)]
mod tests {
    #[test]
    fn adds() {
        assert_eq!(super::add(2, 3), 5);
    }
}
