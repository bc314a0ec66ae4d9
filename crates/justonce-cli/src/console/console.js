// The console's script: keeps the admin token for this tab, loads a page's data with it
// when a token is set, and sends replays to the admin API. No framework, nothing fetched
// from elsewhere.
'use strict';
(() => {
  const TOKEN = 'justonce-admin-token';
  const $ = (selector, root = document) => root.querySelector(selector);
  const token = () => sessionStorage.getItem(TOKEN) || '';
  const withToken = () => (token() ? { Authorization: 'Bearer ' + token() } : {});
  const say = (text) => { $('#status').textContent = text; };

  // A failed answer in words: its problem's title, and detail when it has one.
  async function problemOf(response) {
    try {
      const problem = await response.json();
      return problem.detail ? problem.title + ': ' + problem.detail : problem.title;
    } catch (_) {
      return response.status + ' ' + response.statusText;
    }
  }

  // Asks for this page again, with the token, and shows its new content.
  async function refresh() {
    const response = await fetch(location.href, { headers: withToken(), cache: 'no-store' });
    if (!response.ok) {
      say(await problemOf(response));
      return;
    }
    const fresh = new DOMParser().parseFromString(await response.text(), 'text/html');
    $('main').replaceWith(document.importNode($('main', fresh), true));
  }

  // Sends a change to the admin API; `done` gets its answer. A refusal is shown in the
  // API's own words: without server.admin_token its 403 says how to set one.
  async function change(path, done) {
    let response;
    try {
      response = await fetch(path, { method: 'POST', headers: withToken() });
    } catch (error) {
      say('the service did not answer: ' + error.message);
      return;
    }
    if (!response.ok) {
      const refused = await problemOf(response);
      say(response.status === 401 && !token() ? refused + ' (type the token in the form above)' : refused);
      return;
    }
    done(await response.json());
  }

  // The last attempt shown: a full history drops its oldest as a new one comes, so the
  // count alone does not tell that one came.
  const lastAttempt = () => {
    const rows = document.querySelectorAll('tr.attempt');
    return rows.length ? rows[rows.length - 1].textContent : '';
  };

  // After a replay, loads the page each second until a new attempt shows, for a minute.
  async function awaitAttempt(before) {
    for (let second = 0; second < 60 && lastAttempt() === before; second += 1) {
      await new Promise((resolve) => setTimeout(resolve, 1000));
      await refresh();
    }
  }

  document.addEventListener('submit', (event) => {
    if (event.target.id !== 'token-form') return;
    event.preventDefault();
    const typed = $('#admin-token').value.trim();
    if (typed) sessionStorage.setItem(TOKEN, typed);
    else sessionStorage.removeItem(TOKEN);
    $('#admin-token').value = '';
    say(typed ? 'token kept for this tab' : 'token forgotten');
    refresh();
  });

  document.addEventListener('click', (event) => {
    const button = event.target.closest('button');
    if (!button || button.disabled || button.type === 'submit') return;
    const id = encodeURIComponent(button.dataset.id || '');
    if (button.id === 'replay') {
      const before = lastAttempt();
      change('/api/v1/events/' + id + '/replay', () => {
        say('replayed');
        awaitAttempt(before);
      });
    } else if (button.id === 'replay-matching') {
      if (!window.confirm(button.dataset.confirm)) return;
      change('/api/v1/dead-letters/replay?' + button.dataset.query, (answer) => {
        say('replayed ' + answer.replayed);
        refresh();
      });
    } else if (button.classList.contains('replay')) {
      change('/api/v1/dead-letters/' + id + '/replay', () => {
        say('replayed');
        refresh();
      });
    }
  });

  if ($('main[data-needs-token]') && token()) refresh();
})();
