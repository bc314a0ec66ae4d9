//! A certificate authority of a test's own: a CA certificate and the server and client
//! certificates it signs, as PEM files that the servers under test and the clients read.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// A certificate authority of a test's own, in a temporary folder removed when dropped.
pub struct TestCa {
    folder: PathBuf,
    issuer: Issuer<'static, KeyPair>,
}

impl TestCa {
    /// A new CA with a name of its own, so that a certificate of another `TestCa` is one of
    /// an unknown issuer, not one with a bad signature.
    pub fn new() -> Self {
        let folder = std::env::temp_dir().join(format!("justonce-ca-{}", crate::unique()));
        std::fs::create_dir_all(&folder)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", folder.display()));
        // Servers under test may run as another user (postgres, mysql): they read from here.
        set_mode(&folder, 0o755);
        let key = KeyPair::generate().expect("generate the test CA's key");
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(
            DnType::CommonName,
            format!("justonce test CA {}", crate::unique()),
        );
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let certificate = params.self_signed(&key).expect("self-sign the test CA");
        write(&folder.join("ca.pem"), &certificate.pem());
        Self {
            folder,
            issuer: Issuer::new(params, key),
        }
    }

    /// The CA certificate, PEM.
    pub fn ca_file(&self) -> PathBuf {
        self.folder.join("ca.pem")
    }

    /// A server certificate and its key, PEM, for `names`: DNS names and/or IP addresses.
    pub fn server(&self, names: &[&str]) -> (PathBuf, PathBuf) {
        let names: Vec<String> = names.iter().map(|name| (*name).to_owned()).collect();
        let mut params = CertificateParams::new(names.clone())
            .unwrap_or_else(|e| panic!("server names {names:?}: {e}"));
        params.distinguished_name.push(
            DnType::CommonName,
            names.first().cloned().unwrap_or_default(),
        );
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params, &format!("server-{}", crate::unique()))
    }

    /// A client certificate and its key, PEM, whose common name is `name` (the user name
    /// PostgreSQL's `cert` authentication compares).
    pub fn client(&self, name: &str) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params, &format!("client-{}", crate::unique()))
    }

    fn sign(&self, mut params: CertificateParams, stem: &str) -> (PathBuf, PathBuf) {
        // An ECDSA key signs the handshake; it enciphers nothing.
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().expect("generate a test key");
        let certificate = params
            .signed_by(&key, &self.issuer)
            .expect("sign a test certificate");
        let cert_file = self.folder.join(format!("{stem}.pem"));
        let key_file = self.folder.join(format!("{stem}.key"));
        write(&cert_file, &certificate.pem());
        write(&key_file, &key.serialize_pem());
        (cert_file, key_file)
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// Writes a test file readable by every user: a test key is no secret, and a server running
/// as another user must read it (PostgreSQL wants its own copy, see the cluster).
fn write(path: &Path, pem: &str) {
    std::fs::write(path, pem).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    set_mode(path, 0o644);
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("cannot set the mode of {}: {e}", path.display()));
}
