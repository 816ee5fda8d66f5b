// ESLint 9 flat config for the volunteer page's modules and their node tests (no plugins, so it
// needs nothing beside eslint itself). tests/web/test_web_js.py runs it.

const browser = Object.fromEntries([
  "window", "document", "location", "fetch", "WebSocket", "indexedDB", "IDBDatabase", "CryptoKey", "crypto",
  "performance", "TextEncoder", "TextDecoder", "URL", "URLSearchParams", "setTimeout", "clearTimeout", "setInterval",
  "clearInterval", "atob", "addEventListener", "console", "globalThis", "HTMLElement",
].map((name) => [name, "readonly"]));

export default [
  {
    files: ["moeswarm/web/static/js/**/*.js", "tests/web/js/**/*.mjs"],
    languageOptions: { ecmaVersion: 2023, sourceType: "module", globals: browser },
    linterOptions: { reportUnusedDisableDirectives: "error" },
    rules: {
      "no-undef": "error", "no-unused-vars": ["error", { args: "none" }], "no-unreachable": "error",
      "no-dupe-keys": "error", "no-dupe-class-members": "error", "no-duplicate-imports": "error",
      "no-fallthrough": "error", "no-self-compare": "error", "no-shadow-restricted-names": "error",
      "no-unsafe-finally": "error", "no-unsafe-negation": "error", "no-const-assign": "error",
      "no-constant-condition": "error", "no-empty": "error", "no-redeclare": "error", "no-var": "error",
      "prefer-const": "error", "eqeqeq": "error", "no-implicit-globals": "error", "no-eval": "error",
      "no-new-func": "error", "no-prototype-builtins": "error", "valid-typeof": "error", "use-isnan": "error",
      "no-async-promise-executor": "error", "require-yield": "error", "getter-return": "error",
    },
  },
];
